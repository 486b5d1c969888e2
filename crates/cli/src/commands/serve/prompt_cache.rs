//! The prompt cache: the keys and values of token sequences that earlier requests computed,
//! kept across requests so that a new prompt prefills only what no earlier one shared with
//! it (a chat's earlier turns, a system prompt many users send).
//!
//! A radix tree over token ids, as SGLang's RadixAttention keeps it: each node holds a run
//! of tokens and, for every layer, the keys and values of exactly those positions (given
//! everything on the path above it). Shared prefixes are stored once: two sequences that
//! part after a common system prompt split its node there and hang one branch each below
//! it. A sequence's cache is contiguous ([`GptCache`]), so a hit copies the matched spans
//! into the new sequence's cache rather than pointing at them (a copy of the keys and
//! values costs far less than the forward pass that made them).
//!
//! Memory: the tree holds at most `budget` bytes of keys and values and [`MAX_NODES`]
//! nodes; past either it evicts the least recently used leaves. The running sequences'
//! own caches are not counted here.
//!
//! Exactness: positions restored from the tree are those the same tokens produce (keys and
//! values depend only on the tokens before them), so a reply with a hit equals the reply
//! without one, up to the rounding of prefilling in two passes instead of one.

use std::collections::HashMap;

use anyhow::{bail, Result};
use candle_core::Tensor;
use gpt_blocks::GptCache;

/// Most nodes kept, whatever their size (a stream of tiny distinct prompts must not grow
/// the tree's bookkeeping without bound).
pub const MAX_NODES: usize = 1 << 16;

/// A run of tokens and its keys and values, one `(k, v)` per layer, `[1, h, n, d]` each.
#[derive(Debug)]
struct Node {
    tokens: Vec<u32>,
    span: Vec<(Tensor, Tensor)>,
    bytes: usize,
    parent: usize,
    /// Children by their first token (distinct: the tree is a radix tree).
    children: HashMap<u32, usize>,
    last_used: u64,
}

/// Where a token sequence leaves the tree: the nodes it runs through whole, and then the
/// first `m` tokens of one more node (`partial`), if it goes part way into one.
struct Walk {
    path: Vec<usize>,
    matched: usize,
    partial: Option<(usize, usize)>,
}

/// The prompt cache (see the module's documentation).
#[derive(Debug)]
pub struct PromptCache {
    /// Node 0 is the root (no tokens); freed slots are `None`.
    nodes: Vec<Option<Node>>,
    free: Vec<usize>,
    budget: usize,
    used: usize,
    clock: u64,
}

impl PromptCache {
    /// An empty cache that keeps at most `budget` bytes of keys and values (0: keeps none).
    pub fn new(budget: usize) -> Self {
        let root = Node {
            tokens: Vec::new(),
            span: Vec::new(),
            bytes: 0,
            parent: 0,
            children: HashMap::new(),
            last_used: 0,
        };
        Self {
            nodes: vec![Some(root)],
            free: Vec::new(),
            budget,
            used: 0,
            clock: 0,
        }
    }

    /// Bytes of keys and values held.
    pub fn bytes(&self) -> usize {
        self.used
    }

    /// Nodes held, the root not counted.
    pub fn len(&self) -> usize {
        self.nodes.len() - self.free.len() - 1
    }

    fn node(&self, i: usize) -> &Node {
        // Indices come only from the tree's own links, which never name a freed slot.
        self.nodes[i].as_ref().expect("a live node")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node {
        self.nodes[i].as_mut().expect("a live node")
    }

    fn walk(&self, tokens: &[u32]) -> Walk {
        let mut walk = Walk {
            path: Vec::new(),
            matched: 0,
            partial: None,
        };
        let mut at = 0;
        while let Some(&next) = tokens
            .get(walk.matched)
            .and_then(|t| self.node(at).children.get(t))
        {
            let run = &self.node(next).tokens;
            let rest = &tokens[walk.matched..];
            let m = run.iter().zip(rest).take_while(|(a, b)| a == b).count();
            if m < run.len() {
                walk.partial = Some((next, m));
                break;
            }
            walk.path.push(next);
            walk.matched += m;
            at = next;
        }
        walk
    }

    /// Stores `node` in a free slot, or a new one; returns its index.
    fn add(&mut self, node: Node) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(node);
                i
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        }
    }

    fn touch(&mut self, nodes: impl IntoIterator<Item = usize>) {
        self.clock += 1;
        let now = self.clock;
        for i in nodes {
            self.node_mut(i).last_used = now;
        }
    }

    /// How many of `tokens`' first positions the tree holds.
    pub fn matched(&self, tokens: &[u32]) -> usize {
        let w = self.walk(tokens);
        w.matched + w.partial.map_or(0, |(_, m)| m)
    }

    /// Puts the keys and values of the longest prefix of `tokens` the tree holds into
    /// `cache` (which must be empty) and returns its length.
    pub fn restore(&mut self, tokens: &[u32], cache: &mut GptCache) -> Result<usize> {
        if !cache.is_empty() {
            bail!("prompt cache: restoring into a cache that holds positions")
        }
        let w = self.walk(tokens);
        for &i in &w.path {
            cache.extend(&self.node(i).span)?;
        }
        let mut len = w.matched;
        if let Some((i, m)) = w.partial.filter(|&(_, m)| m > 0) {
            let part = self
                .node(i)
                .span
                .iter()
                .map(|(k, v)| Ok((k.narrow(2, 0, m)?, v.narrow(2, 0, m)?)))
                .collect::<Result<Vec<_>>>()?;
            cache.extend(&part)?;
            len += m;
        }
        let used = w.path.into_iter().chain(w.partial.map(|(i, _)| i));
        self.touch(used);
        Ok(len)
    }

    /// Keeps `cache`'s positions, the keys and values of `tokens` (one per position), then
    /// evicts least recently used leaves until the tree fits its budget.
    pub fn insert(&mut self, tokens: &[u32], cache: &GptCache) -> Result<()> {
        if tokens.len() != cache.len() {
            bail!(
                "prompt cache: {} tokens for a cache of {} positions",
                tokens.len(),
                cache.len()
            )
        }
        if self.budget == 0 || tokens.is_empty() {
            return Ok(());
        }
        let w = self.walk(tokens);
        let partial = w.partial.filter(|&(_, m)| m > 0);
        let pos = w.matched + partial.map_or(0, |(_, m)| m);
        let span = match pos < tokens.len() {
            true => Some(cache.span(pos, tokens.len() - pos)?),
            false => None,
        };
        if span.as_ref().is_some_and(|s| span_bytes(s) > self.budget) {
            return Ok(()); // it would evict everything else and then itself
        }
        let mut path = w.path;
        let mut at = path.last().copied().unwrap_or(0);
        if let Some((child, m)) = partial {
            at = self.split(child, m)?;
            path.push(at);
        }
        if let Some(span) = span {
            let leaf = Node {
                tokens: tokens[pos..].to_vec(),
                bytes: span_bytes(&span),
                span,
                parent: at,
                children: HashMap::new(),
                last_used: 0,
            };
            self.used += leaf.bytes;
            let first = leaf.tokens[0];
            let i = self.add(leaf);
            self.node_mut(at).children.insert(first, i);
            path.push(i);
        }
        self.touch(path);
        self.evict();
        Ok(())
    }

    /// Splits `i` after its first `m` tokens (0 < m < its length) into a parent holding them
    /// and `i` holding the rest; returns the new parent.
    fn split(&mut self, i: usize, m: usize) -> Result<usize> {
        let node = self.node(i);
        let n = node.tokens.len();
        let cut = |from: usize, len: usize| -> Result<Vec<(Tensor, Tensor)>> {
            node.span
                .iter()
                .map(|(k, v)| {
                    let take = |t: &Tensor| t.narrow(2, from, len)?.force_contiguous();
                    Ok((take(k)?, take(v)?))
                })
                .collect()
        };
        let (head, tail) = (cut(0, m)?, cut(m, n - m)?);
        let parent = node.parent;
        let head = Node {
            tokens: node.tokens[..m].to_vec(),
            bytes: span_bytes(&head),
            span: head,
            parent,
            children: HashMap::new(),
            last_used: node.last_used,
        };
        let j = self.add(head);
        let node = self.node_mut(i);
        node.tokens.drain(..m);
        node.bytes = span_bytes(&tail);
        node.span = tail;
        node.parent = j;
        let (first_head, first_tail) = (self.node(j).tokens[0], self.node(i).tokens[0]);
        self.node_mut(j).children.insert(first_tail, i);
        self.node_mut(parent).children.insert(first_head, j);
        Ok(j)
    }

    /// Evicts least recently used leaves until the tree fits its budget and node count.
    fn evict(&mut self) {
        while self.used > self.budget || self.len() > MAX_NODES {
            let leaf = self
                .nodes
                .iter()
                .enumerate()
                .skip(1)
                .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
                .filter(|(_, n)| n.children.is_empty())
                .min_by_key(|(_, n)| n.last_used)
                .map(|(i, _)| i);
            let Some(i) = leaf else { return };
            if let Some(node) = self.nodes[i].take() {
                self.used -= node.bytes;
                self.node_mut(node.parent).children.remove(&node.tokens[0]);
                self.free.push(i);
            }
        }
    }
}

fn span_bytes(span: &[(Tensor, Tensor)]) -> usize {
    span.iter()
        .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use candle_nn::{VarBuilder, VarMap};
    use gpt_blocks::{Gpt, GptConfig, Logits};

    fn tiny() -> Gpt {
        let cfg = GptConfig {
            vocab_size: 50,
            n_positions: 64,
            n_embd: 16,
            n_layer: 2,
            n_head: 4,
            ..GptConfig::gpt2()
        };
        let vm = VarMap::new();
        Gpt::new(&cfg, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap()
    }

    /// The cache `tokens` make when run in one pass.
    fn run(model: &Gpt, tokens: &[u32]) -> GptCache {
        let mut cache = model.new_cache(64);
        let ids = Tensor::new(tokens, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        model
            .infer(&ids, None, Some(&mut cache), Logits::Last)
            .unwrap();
        cache
    }

    fn max_diff(a: &GptCache, b: &GptCache) -> f32 {
        let len = a.len();
        assert_eq!(len, b.len());
        let (a, b) = (a.span(0, len).unwrap(), b.span(0, len).unwrap());
        a.iter()
            .zip(&b)
            .flat_map(|((ka, va), (kb, vb))| [(ka, kb), (va, vb)])
            .map(|(x, y)| {
                let d = (x - y).unwrap().abs().unwrap().flatten_all().unwrap();
                d.max(0).unwrap().to_scalar::<f32>().unwrap()
            })
            .fold(0.0, f32::max)
    }

    /// Sequences that share prefixes restore the keys and values their tokens make,
    /// through splits at every depth; what was never stored is not restored.
    #[test]
    fn restores_the_longest_stored_prefix_exactly() {
        let model = tiny();
        let mut pc = PromptCache::new(usize::MAX);
        let a: Vec<u32> = (1..=20).collect();
        let mut b = a[..12].to_vec();
        b.extend([40, 41, 42, 43]);
        let mut c = a[..5].to_vec();
        c.extend([30, 31]);
        for s in [&a, &b, &c] {
            pc.insert(s, &run(&model, s)).unwrap();
        }
        // The root's child (5 tokens), under it a split at 12 and the 7-token branch.
        assert_eq!(pc.len(), 5);
        let mut d = a[..15].to_vec();
        d.extend([9, 9, 9]);
        for (prompt, want) in [(&a, 20), (&b, 16), (&c, 7), (&d, 15)] {
            assert_eq!(pc.matched(prompt), want);
            let mut cache = model.new_cache(4);
            assert_eq!(pc.restore(prompt, &mut cache).unwrap(), want);
            let full = run(&model, &prompt[..want]);
            // Equal up to the rounding of passes of other lengths (the positions shared
            // with `a` were stored from `a`'s pass).
            let d = max_diff(&cache, &full);
            assert!(d < 1e-6, "{prompt:?}: {d}");
        }
        let mut cache = model.new_cache(4);
        assert_eq!(pc.restore(&[7, 1, 2], &mut cache).unwrap(), 0);
        assert!(cache.is_empty());
        // Storing a prefix of what is held adds nothing.
        let (bytes, nodes) = (pc.bytes(), pc.len());
        pc.insert(&a[..12], &run(&model, &a[..12])).unwrap();
        assert_eq!((pc.bytes(), pc.len()), (bytes, nodes));
    }

    /// The budget holds after every insertion; the least recently used branch goes first,
    /// and a branch used since survives.
    #[test]
    fn evicts_least_recently_used_within_the_budget() {
        let model = tiny();
        let one = span_bytes(&run(&model, &[1]).span(0, 1).unwrap()); // bytes per position
        let mut pc = PromptCache::new(30 * one);
        let seqs: Vec<Vec<u32>> = (0..4).map(|i| vec![10 + i; 10]).collect();
        for s in &seqs[..3] {
            pc.insert(s, &run(&model, s)).unwrap();
        }
        assert_eq!(pc.bytes(), 30 * one);
        let mut cache = model.new_cache(4);
        pc.restore(&seqs[0], &mut cache).unwrap(); // seqs[1] is now the oldest
        pc.insert(&seqs[3], &run(&model, &seqs[3])).unwrap();
        assert_eq!(pc.bytes(), 30 * one);
        let held: Vec<usize> = seqs.iter().map(|s| pc.matched(s)).collect();
        assert_eq!(held, [10, 0, 10, 10]);
        // A sequence larger than the budget is not kept, and evicts nothing.
        let long: Vec<u32> = (0..40).map(|i| i % 50).collect();
        pc.insert(&long, &run(&model, &long)).unwrap();
        let held: Vec<usize> = seqs.iter().map(|s| pc.matched(s)).collect();
        assert_eq!(held, [10, 0, 10, 10]);
        assert_eq!(PromptCache::new(0).bytes(), 0);
        let mut off = PromptCache::new(0);
        off.insert(&seqs[0], &run(&model, &seqs[0])).unwrap();
        assert_eq!((off.bytes(), off.len()), (0, 0));
    }
}
