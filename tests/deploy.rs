//! `deploy/`: no container builder can be installed from the package registries here, so
//! the Dockerfile and the Kubernetes example are linted instead of built: the properties
//! the README promises (a multi-stage build, a non-root user, `gpt serve` listening on the
//! container's port, readiness on `/health`, one port throughout) are checked in the text,
//! and the options they pass to `gpt serve` against its arguments.

use std::path::Path;

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Lines that are not comments.
fn code(text: &str) -> Vec<&str> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

#[test]
fn dockerfile_builds_in_one_stage_and_serves_from_another_as_a_user() {
    let text = read("deploy/Dockerfile");
    let lines = code(&text);
    let froms: Vec<_> = lines.iter().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(
        froms.len(),
        2,
        "a build stage and a runtime stage: {froms:?}"
    );
    assert!(froms[0].ends_with(" AS build"), "{}", froms[0]);
    assert!(lines.iter().any(|l| l.starts_with("COPY --from=build ")));
    assert!(lines.iter().any(|l| l.contains("cargo build --release")));
    // The last USER of the runtime stage is not root.
    let runtime = lines
        .iter()
        .skip_while(|l| !l.starts_with("FROM ") || l.ends_with(" AS build"))
        .copied()
        .collect::<Vec<_>>();
    let user = runtime
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER in the runtime stage");
    assert!(!["root", "0"].contains(&user.trim()), "runs as {user}");
    assert!(runtime.contains(&"EXPOSE 8080"));
    let entry = runtime
        .iter()
        .find(|l| l.starts_with("ENTRYPOINT "))
        .expect("an ENTRYPOINT");
    for part in ["serve", "--host 0.0.0.0", "--port 8080", "$GPT_MODEL"] {
        assert!(entry.contains(part), "{part} in {entry}");
    }
    // The build context leaves the build output out.
    assert!(code(&read(".dockerignore")).contains(&"target"));
}

#[test]
fn kubernetes_example_probes_health_on_the_served_port() {
    let text = read("deploy/kubernetes.yaml");
    let lines = code(&text);
    for want in [
        "kind: Deployment",
        "kind: Service",
        "readinessProbe:",
        "livenessProbe:",
        "path: /health",
        "containerPort: 8080",
        "runAsNonRoot: true",
        "targetPort: http",
        "readOnly: true",
    ] {
        assert!(lines.contains(&want), "{want} in deploy/kubernetes.yaml");
    }
    // Every option passed to `gpt serve` is one of its arguments (clap's `--max-batch` is
    // the field `max_batch` of ServeArgs).
    let args = lines
        .iter()
        .find_map(|l| l.strip_prefix("args: "))
        .expect("the container's args");
    let serve = read("crates/cli/src/commands/serve/mod.rs");
    for opt in args.split('"').filter(|s| s.starts_with("--")) {
        let field = format!("pub {}: ", opt.trim_start_matches('-').replace('-', "_"));
        assert!(serve.contains(&field), "gpt serve has no {opt}");
    }
    for env in ["GPT_MODEL", "GPT_API_KEY"] {
        assert!(lines.contains(&format!("- name: {env}").as_str()), "{env}");
    }
}
