//! The deployment files checked against the code, without a Docker engine:
//! they parse, every command is a real binary and subcommand, every variable
//! they set is a setting the binary accepts (the binary itself validates it
//! with `--check-config`), and ports, probes and queue names agree.
//! `scripts/compose-test.sh` runs the compose file itself where Docker can run.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use sas_messages::QueueNames;
use sas_tests::process::bin_dir;
use serde_yaml::Value;

const BINARIES: [&str; 5] = ["scheduler", "agent", "supervisor", "remote-sim", "sasctl"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn load_yaml_documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|document| {
            let mut value = Value::deserialize(document)
                .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()));
            value.apply_merge().unwrap();
            value
        })
        .filter(|value| !value.is_null())
        .collect()
}

use serde::Deserialize;

/// `${NAME:-default}` becomes `default`; `${NAME}` and `${NAME:?message}` a placeholder.
fn interpolate(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').expect("closing brace") + start;
        let inner = &rest[start + 2..end];
        out.push_str(match inner.split_once(":-") {
            Some((_, default)) => default,
            None => "placeholder",
        });
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

fn as_str(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Null => String::new(),
        other => panic!("not a scalar: {other:?}"),
    }
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_sequence()
        .map(|items| items.iter().map(as_str).collect())
        .unwrap_or_default()
}

/// Runs `command` (binary and arguments) with `--check-config` and exactly
/// `env` as its `SAS_*` environment; asserts exit 0.
fn check_config(context: &str, command: &[String], env: &BTreeMap<String, String>) {
    let (binary, args) = command.split_first().expect("a command");
    assert!(
        BINARIES.contains(&binary.as_str()),
        "{context}: {binary} is not one of our binaries"
    );
    let help = std::process::Command::new(bin_dir().join(binary))
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(
        help.status.success(),
        "{context}: `{} --help` fails: {}",
        command.join(" "),
        String::from_utf8_lossy(&help.stderr)
    );
    if binary == "sasctl" {
        return;
    }
    let mut process = std::process::Command::new(bin_dir().join(binary));
    process.arg("--check-config").args(args);
    for (key, _) in std::env::vars() {
        if key.starts_with("SAS_") {
            process.env_remove(key);
        }
    }
    process.envs(env);
    let output = process.output().unwrap();
    assert!(
        output.status.success(),
        "{context}: `{} --check-config` refuses its environment {env:?}: {}",
        command.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The settings sections of `binary`, from its compiled-in defaults.
fn sections_of(binary: &str) -> Vec<String> {
    let defaults =
        std::fs::read_to_string(root().join("crates").join(binary).join("defaults.toml")).unwrap();
    defaults
        .lines()
        .filter_map(|l| l.trim().strip_prefix('[').and_then(|l| l.strip_suffix(']')))
        .map(|section| section.split('.').next().unwrap().to_owned())
        .collect()
}

fn listen_port(context: &str, env: &BTreeMap<String, String>) -> u16 {
    let listen = env
        .get("SAS_HTTP__LISTEN")
        .unwrap_or_else(|| panic!("{context}: SAS_HTTP__LISTEN is not set"));
    listen.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn docker_compose_runs_real_binaries_with_settings_they_accept() {
    let compose = load_yaml_documents(&root().join("docker-compose.yml")).remove(0);
    let services = compose["services"].as_mapping().expect("services");
    let names: Vec<String> = services.keys().map(as_str).collect();
    for expected in [
        "rabbitmq",
        "postgres",
        "migrate",
        "scheduler",
        "supervisor",
        "agent",
        "remote-sim",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "no {expected} service: {names:?}"
        );
    }
    let text = std::fs::read_to_string(root().join("docker-compose.yml")).unwrap();
    assert!(
        !text.contains("container_name"),
        "fixed container names prevent scaling"
    );

    for (name, service) in services {
        let name = as_str(name);
        let Some(command) = service.get("command") else {
            continue;
        };
        let command = strings(command);
        let env: BTreeMap<String, String> = service
            .get("environment")
            .and_then(Value::as_mapping)
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (as_str(k), interpolate(&as_str(v))))
                    .collect()
            })
            .unwrap_or_default();
        check_config(&format!("compose service {name}"), &command, &env);

        if ["scheduler", "supervisor", "agent"].contains(&name.as_str()) {
            for port in strings(service.get("ports").unwrap_or(&Value::Null)) {
                assert!(
                    !port.contains(':'),
                    "{name} publishes a fixed host port {port}: it cannot scale"
                );
            }
            let conditions = &service["depends_on"];
            assert_eq!(
                as_str(&conditions["rabbitmq"]["condition"]),
                "service_healthy",
                "{name}"
            );
            if name != "agent" {
                assert_eq!(
                    as_str(&conditions["postgres"]["condition"]),
                    "service_healthy",
                    "{name}"
                );
                assert_eq!(
                    as_str(&conditions["migrate"]["condition"]),
                    "service_completed_successfully",
                    "{name}"
                );
                assert_eq!(
                    env.get("SAS_DATABASE__MIGRATE").map(String::as_str),
                    Some("false"),
                    "{name} leaves migrations to the migrate job"
                );
            }
        }
        if name != "migrate" {
            // The health check probes the port the service listens on.
            let port = listen_port(&name, &env);
            let test = strings(&service["healthcheck"]["test"]);
            assert_eq!(&test[1..3], ["sasctl", "probe"], "{name}: {test:?}");
            assert!(
                test[3].starts_with(&format!("http://127.0.0.1:{port}/")),
                "{name}: probes {} but listens on {port}",
                test[3]
            );
        }
    }
    // Two schedulers and two supervisors by default, to show they coexist.
    for name in ["scheduler", "supervisor"] {
        assert_eq!(
            services[name]["deploy"]["replicas"].as_u64(),
            Some(2),
            "{name}"
        );
    }
    // Every service shares one prefix, so they agree on queue names.
    let prefixes: Vec<String> = services
        .values()
        .filter_map(|s| {
            s.get("environment")
                .and_then(|e| e.get("SAS_AMQP__PREFIX"))
                .map(as_str)
        })
        .collect();
    assert!(prefixes.windows(2).all(|w| w[0] == w[1]), "{prefixes:?}");
}

#[test]
fn kubernetes_manifests_agree_with_the_binaries_probes_and_queues() {
    let dir = root().join("deploy/k8s");
    let mut documents = Vec::new();
    // `kubectl apply -f deploy/k8s/` applies the .yaml files only.
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    files.sort();
    for file in &files {
        documents.extend(load_yaml_documents(file));
    }
    let kind = |doc: &Value| as_str(&doc["kind"]);
    // The example Secret is never applied over a real one.
    assert!(
        !documents.iter().any(|d| kind(d) == "Secret"),
        "an applied manifest holds a Secret: it would overwrite the real one"
    );
    let example = load_yaml_documents(&dir.join("02-secret.yaml.example"));
    let config: BTreeMap<String, String> = documents
        .iter()
        .find(|d| kind(d) == "ConfigMap")
        .and_then(|d| d["data"].as_mapping())
        .map(|m| m.iter().map(|(k, v)| (as_str(k), as_str(v))).collect())
        .expect("a ConfigMap");
    let secret: HashMap<String, String> = example
        .iter()
        .find(|d| kind(d) == "Secret")
        .and_then(|d| d["stringData"].as_mapping())
        .map(|m| m.iter().map(|(k, v)| (as_str(k), as_str(v))).collect())
        .expect("a Secret");

    let every_section: Vec<String> = ["scheduler", "agent", "supervisor", "remote-sim"]
        .iter()
        .flat_map(|b| sections_of(b))
        .collect();
    for key in config.keys() {
        assert!(
            every_section
                .iter()
                .any(|s| key.to_lowercase().starts_with(&format!("sas_{s}__"))),
            "ConfigMap key {key} is a setting of no binary"
        );
    }
    let mut agent_queues = Vec::new();
    let mut deployments = Vec::new();
    for doc in documents
        .iter()
        .filter(|d| ["Deployment", "Job"].contains(&kind(d).as_str()))
    {
        let name = as_str(&doc["metadata"]["name"]);
        let pod = &doc["spec"]["template"]["spec"];
        let container = &pod["containers"][0];
        let command = strings(&container["args"]);
        // The shared ConfigMap serves every binary; each reads the sections it has.
        let sections = sections_of(&command[0]);
        let mut env: BTreeMap<String, String> = config
            .iter()
            .filter(|(key, _)| {
                sections
                    .iter()
                    .any(|s| key.to_lowercase().starts_with(&format!("sas_{s}__")))
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for var in container["env"].as_sequence().cloned().unwrap_or_default() {
            let value = match var.get("value") {
                Some(value) => as_str(value),
                None => {
                    let key = as_str(&var["valueFrom"]["secretKeyRef"]["key"]);
                    secret
                        .get(&key)
                        .cloned()
                        .unwrap_or_else(|| panic!("{name}: secret key {key} does not exist"))
                }
            };
            env.insert(as_str(&var["name"]), value);
        }
        check_config(&format!("k8s {name}"), &command, &env);
        let security = &container["securityContext"];
        assert_eq!(
            security["runAsNonRoot"].as_bool(),
            Some(true),
            "{name} runs as non-root"
        );
        if kind(doc) == "Job" {
            continue;
        }
        deployments.push((name.clone(), doc["spec"]["selector"]["matchLabels"].clone()));
        let port = listen_port(&name, &env);
        assert_eq!(
            container["ports"][0]["containerPort"].as_u64(),
            Some(u64::from(port)),
            "{name}: container port"
        );
        let probe_path = |probe: &str| as_str(&container[probe]["httpGet"]["path"]);
        assert_eq!(probe_path("livenessProbe"), "/healthz", "{name}");
        assert_eq!(probe_path("readinessProbe"), "/readyz", "{name}");
        if command[0] == "agent" {
            let names = QueueNames::new(env.get("SAS_AMQP__PREFIX").cloned().unwrap_or_default());
            for agent in env["SAS_AGENT__NAME"].split(',') {
                agent_queues.push((name.clone(), names.agent_requests(agent.trim())));
            }
        }
    }
    // KEDA scales the agent Deployment on exactly the queues its replicas consume.
    let scaled = documents
        .iter()
        .find(|d| kind(d) == "ScaledObject")
        .expect("a KEDA ScaledObject");
    let target = as_str(&scaled["spec"]["scaleTargetRef"]["name"]);
    let mut triggered: Vec<String> = scaled["spec"]["triggers"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|t| {
            assert_eq!(as_str(&t["type"]), "rabbitmq");
            as_str(&t["metadata"]["queueName"])
        })
        .collect();
    let mut consumed: Vec<String> = agent_queues
        .iter()
        .filter(|(d, _)| *d == target)
        .map(|(_, q)| q.clone())
        .collect();
    triggered.sort();
    consumed.sort();
    assert!(
        !consumed.is_empty(),
        "the ScaledObject targets {target}, which is not an agent Deployment"
    );
    assert_eq!(triggered, consumed);
    // Every PodDisruptionBudget selects a Deployment.
    for pdb in documents
        .iter()
        .filter(|d| kind(d) == "PodDisruptionBudget")
    {
        let selector = &pdb["spec"]["selector"]["matchLabels"];
        assert!(
            deployments.iter().any(|(_, labels)| labels == selector),
            "PDB {} selects nothing",
            as_str(&pdb["metadata"]["name"])
        );
    }
    for required in ["scheduler", "supervisor", "agent"] {
        assert!(
            deployments.iter().any(|(n, _)| n == required),
            "no {required} Deployment"
        );
    }
}

#[test]
fn the_image_is_multi_stage_and_runs_every_binary_as_a_non_root_user() {
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    let stages = dockerfile
        .lines()
        .filter(|l| l.trim_start().starts_with("FROM "))
        .count();
    assert!(stages >= 2, "multi-stage build");
    let user = dockerfile
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with("USER "))
        .expect("a USER line");
    let user = user.trim_start().trim_start_matches("USER ").trim();
    assert!(user != "root" && user != "0", "runs as {user}");
    for binary in BINARIES {
        assert!(
            dockerfile.contains(&format!("target/release/{binary}")),
            "the image lacks {binary}"
        );
    }
    assert!(
        !dockerfile
            .lines()
            .any(|l| l.trim_start().starts_with("ENV ") && l.contains("SAS_")),
        "no settings or credentials baked into the image"
    );
    // A `# syntax=` line makes BuildKit fetch a frontend image from a registry.
    assert!(
        !dockerfile
            .lines()
            .any(|l| l.trim_start().to_lowercase().starts_with("# syntax=")),
        "the Dockerfile asks for a frontend image"
    );
    // It builds the shipped packages only, offline and locked.
    let build = dockerfile
        .split("RUN ")
        .find(|step| step.contains("cargo build"))
        .expect("a cargo build step")
        .replace("\\\n", " ");
    let command = build.split("&&").next().unwrap_or_default();
    let words: Vec<&str> = command.split_whitespace().collect();
    let packages: Vec<&str> = words
        .windows(2)
        .filter(|w| w[0] == "-p" || w[0] == "--package")
        .map(|w| w[1])
        .collect();
    assert_eq!(packages, BINARIES, "packages built: {build}");
    for flag in ["--release", "--locked", "--offline"] {
        assert!(words.contains(&flag), "cargo build without {flag}: {build}");
    }
    for flag in ["--workspace", "--all", "--bins"] {
        assert!(
            !words.contains(&flag),
            "cargo build {flag} compiles what the image does not ship: {build}"
        );
    }
    // Every package the image builds is one of its binaries.
    for package in &packages {
        let manifest =
            std::fs::read_to_string(root().join("crates").join(package).join("Cargo.toml"))
                .unwrap_or_else(|e| panic!("package {package} is not crates/{package}: {e}"));
        assert!(
            manifest.contains(&format!("name = \"{package}\"")),
            "{package}"
        );
    }
}

/// Every `${NAME...}` reference of a compose file: (name, what follows it).
fn variables(text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        let end = rest[start..].find('}').expect("closing brace") + start;
        let inner = &rest[start + 2..end];
        let cut = inner.find([':', '-', '?']).unwrap_or(inner.len());
        found.push((inner[..cut].to_owned(), inner[cut..].to_owned()));
        rest = &rest[end + 1..];
    }
    found
}

#[test]
fn compose_is_closed_by_default_and_its_development_values_are_labelled() {
    let text = std::fs::read_to_string(root().join("docker-compose.yml")).unwrap();
    let compose = load_yaml_documents(&root().join("docker-compose.yml")).remove(0);
    let services = compose["services"].as_mapping().expect("services");
    // Nothing is published on all interfaces.
    for (name, service) in services {
        for port in strings(service.get("ports").unwrap_or(&Value::Null)) {
            assert!(
                port.starts_with("127.0.0.1:"),
                "{} publishes {port} on every interface",
                as_str(name)
            );
        }
    }
    // The override publishes them wider.
    let public = load_yaml_documents(&root().join("docker-compose.public.yml")).remove(0);
    let mut widened = Vec::new();
    for (name, service) in public["services"].as_mapping().expect("services") {
        let ports = match &service["ports"] {
            Value::Tagged(tagged) => tagged.value.clone(),
            other => other.clone(),
        };
        for port in strings(&ports) {
            assert!(!port.starts_with("127.0.0.1"), "{port}");
            widened.push(as_str(name));
        }
    }
    for name in ["rabbitmq", "remote-sim"] {
        assert!(widened.iter().any(|n| n == name), "{name} is not widened");
    }
    // No password has a default: compose stops, naming the variable.
    let example = std::fs::read_to_string(root().join(".env.example")).unwrap();
    assert!(example.contains("DEVELOPMENT"), "the example is labelled");
    let defined: Vec<&str> = example
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('=').map(|(k, _)| k.trim()))
        .collect();
    let mut required = 0;
    for (name, rest) in variables(&text) {
        if name.contains("PASSWORD") || name.contains("TOKEN") {
            assert!(
                rest.starts_with(":?") && rest.contains(&name),
                "${{{name}{rest}}} must be required, with a message naming it"
            );
            required += 1;
        }
        if rest.starts_with(":?") {
            assert!(
                defined.contains(&name.as_str()),
                "{name} is required by compose but not in .env.example"
            );
        }
    }
    assert!(required >= 7, "{required} required passwords and tokens");
    // remote-sim's ledger and admin routes are published on the host: never open.
    assert!(
        services["remote-sim"]["environment"]
            .get("SAS_SIM__ADMIN_TOKEN")
            .is_some(),
        "remote-sim serves /admin and /side-effects without a token"
    );
    // Each role logs in as its own broker user; schedulers and supervisors
    // trust the agents' and services' users by name.
    let url_user = |service: &str| {
        let url = as_str(&services[service]["environment"]["SAS_AMQP__URL"]);
        url.split("://")
            .nth(1)
            .unwrap()
            .split(':')
            .next()
            .unwrap()
            .to_owned()
    };
    let (scheduler, supervisor, agent) = (
        url_user("scheduler"),
        url_user("supervisor"),
        url_user("agent"),
    );
    assert!(scheduler != supervisor && supervisor != agent && agent != scheduler);
    for service in ["scheduler", "supervisor"] {
        let env = &services[service]["environment"];
        assert_eq!(as_str(&env["SAS_AMQP__AGENT_USERS"]), agent, "{service}");
        let users = as_str(&env["SAS_AMQP__SERVICE_USERS"]);
        assert!(
            users.split(',').any(|u| u == scheduler) && users.split(',').any(|u| u == supervisor),
            "{service}: {users}"
        );
    }
    // The broker's own bounds and users are set up by files it mounts.
    let rabbitmq = strings(&services["rabbitmq"]["volumes"]).join(" ");
    for file in [
        "deploy/rabbitmq/20-sas.conf",
        "deploy/rabbitmq/setup-users.sh",
    ] {
        assert!(rabbitmq.contains(file), "rabbitmq does not mount {file}");
    }
    let conf = std::fs::read_to_string(root().join("deploy/rabbitmq/20-sas.conf")).unwrap();
    assert!(
        conf.lines().any(|l| l.starts_with("max_message_size =")),
        "{conf}"
    );
    let script = std::fs::read_to_string(root().join("deploy/rabbitmq/setup-users.sh")).unwrap();
    for user in [scheduler, supervisor, agent] {
        assert!(
            script.contains(&format!(":-{user}}}")),
            "setup-users.sh does not create {user}"
        );
    }
}

/// `(host part, container port)` of each published port of `service`, with
/// the host part as written (`${VARIABLE:-default}`), the address removed.
fn published(compose: &Value, service: &str) -> Vec<(String, String)> {
    let ports = match &compose["services"][service]["ports"] {
        Value::Tagged(tagged) => tagged.value.clone(),
        other => other.clone(),
    };
    strings(&ports)
        .iter()
        .map(|port| {
            let port = port.strip_prefix("127.0.0.1:").unwrap_or(port);
            let (host, container) = port
                .rsplit_once(':')
                .unwrap_or_else(|| panic!("{service}: {port} has no host part"));
            (host.to_owned(), container.to_owned())
        })
        .collect()
}

#[test]
fn every_published_host_port_is_a_variable_whose_default_is_unchanged() {
    // Beside a RabbitMQ on the host's 5672 (ours, or the tests' own compose
    // run), the host ports must move without editing the files.
    let expected = [
        ("rabbitmq", "${RABBITMQ_AMQP_PORT:-5672}", "5672"),
        ("rabbitmq", "${RABBITMQ_MANAGEMENT_PORT:-15672}", "15672"),
        // Empty: a random free port, as before.
        ("remote-sim", "${REMOTE_SIM_PORT:-}", "8080"),
    ];
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let example = std::fs::read_to_string(root().join(".env.example")).unwrap();
    for file in ["docker-compose.yml", "docker-compose.public.yml"] {
        let compose = load_yaml_documents(&root().join(file)).remove(0);
        let mut found: Vec<(String, String, String)> = Vec::new();
        for (name, _) in compose["services"].as_mapping().expect("services") {
            let name = as_str(name);
            for (host, container) in published(&compose, &name) {
                found.push((name.clone(), host, container));
            }
        }
        let mut expected: Vec<(String, String, String)> = expected
            .iter()
            .map(|(s, h, c)| ((*s).to_owned(), (*h).to_owned(), (*c).to_owned()))
            .collect();
        found.sort();
        expected.sort();
        assert_eq!(found, expected, "{file}: published ports");
    }
    for variable in [
        "RABBITMQ_AMQP_PORT",
        "RABBITMQ_MANAGEMENT_PORT",
        "REMOTE_SIM_PORT",
    ] {
        assert!(
            readme.contains(&format!("`{variable}`")),
            "the README does not document {variable}"
        );
        assert!(
            example.contains(variable),
            ".env.example does not mention {variable}"
        );
    }
}

#[test]
fn check_config_names_a_bad_key_and_an_unknown_variable() {
    let run = |vars: &[(&str, &str)]| {
        let mut process = std::process::Command::new(bin_dir().join("scheduler"));
        process.arg("--check-config");
        for (key, _) in std::env::vars() {
            if key.starts_with("SAS_") {
                process.env_remove(key);
            }
        }
        process.envs(vars.iter().copied());
        let output = process.output().unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    assert_eq!(run(&[]).0, Some(0));
    let (code, error) = run(&[("SAS_SCHEDULER__CLAIM_BATCH", "0")]);
    assert_eq!(code, Some(2));
    assert!(error.contains("scheduler.claim_batch"), "{error}");
    let (code, error) = run(&[("SAS_SCHEDULER__CLAIM_BACH", "5")]);
    assert_eq!(code, Some(2));
    assert!(error.contains("claim_bach"), "{error}");
    let (code, error) = run(&[("SAS_SCHEDULR__ID", "x")]);
    assert_eq!(code, Some(2));
    assert!(error.contains("SAS_SCHEDULR__ID"), "{error}");
    let (code, error) = run(&[("SAS_AMQP__URL", "http://nope")]);
    assert_eq!(code, Some(2));
    assert!(error.contains("amqp.url"), "{error}");
    let (code, error) = run(&[("SAS_DATABASE__SSL_MODE", "verify_full")]);
    assert_eq!(code, Some(2));
    assert!(
        error.contains("database.ssl_mode") && error.contains("verify-full"),
        "{error}"
    );
    assert_eq!(run(&[("SAS_DATABASE__SSL_MODE", "verify-full")]).0, Some(0));
}
