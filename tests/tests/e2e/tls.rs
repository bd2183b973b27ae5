//! TLS end to end (issue 47): every service reaches RabbitMQ over
//! `amqps://` and Postgres with `verify-full`, both trusting the
//! development CA `scripts/dev-ca.sh` makes (as compose's TLS does), and
//! the gateway and the console serve HTTPS only with the certificate it
//! signed; `sasctl probe` (compose's health checks) checks them. An order submitted over HTTPS is processed and
//! read back; plain HTTP gets no answer from the gateway; the database
//! takes no connection without TLS, and every service's connection to it
//! is encrypted.
//!
//! The broker side is a TLS front ([`sas_tests::tls_proxy`]) before the
//! shared broker, which speaks plain AMQP: the services' side (the
//! handshake, the CA, the host name checked) is what is tested; the
//! broker's own TLS listener is RabbitMQ's, configured in compose
//! (docs/tls.md).

use std::time::Duration;

use reqwest::StatusCode;
use sas_tests::postgres_pair::TlsPostgres;
use sas_tests::process::{free_port, hash_secret};
use sas_tests::tls_proxy::TlsProxy;
use sas_tests::{order, wait_until, Setting, TestEnv};
use serde_json::Value;
use sqlx::Connection as _;

use crate::gateway::SECRET;

/// The files `scripts/dev-ca.sh` makes, in `dir`.
struct DevCa {
    ca: std::path::PathBuf,
    ca_pem: String,
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
}

fn dev_ca(dir: &std::path::Path) -> DevCa {
    let made = std::process::Command::new("bash")
        .arg(sas_tests::repo_root().join("scripts/dev-ca.sh"))
        .env("DEV_CA_DIR", dir)
        .output()
        .expect("run scripts/dev-ca.sh");
    assert!(
        made.status.success(),
        "scripts/dev-ca.sh: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    DevCa {
        ca: dir.join("ca.pem"),
        ca_pem: std::fs::read_to_string(dir.join("ca.pem")).unwrap(),
        cert: dir.join("server.pem"),
        key: dir.join("server-key.pem"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_connection_is_tls_when_configured_and_an_order_runs_through() {
    let env = TestEnv::new().await;
    let pki = dev_ca(&env.dir.join("tls"));
    let cert_pem = std::fs::read_to_string(&pki.cert).unwrap();
    let key_pem = std::fs::read_to_string(&pki.key).unwrap();
    let postgres = {
        let (cert, key) = (cert_pem.clone(), key_pem.clone());
        tokio::task::spawn_blocking(move || TlsPostgres::start(&cert, &key))
            .await
            .expect("start a Postgres that takes TLS only")
    };
    // Without TLS, the database takes nobody.
    let plain = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable",
        postgres.port
    );
    let refused = sqlx::PgConnection::connect(&plain).await.map(drop);
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("no encryption")),
        "a plain connection: {refused:?}"
    );
    let verified = |database: &str| {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}?sslmode=verify-full&sslrootcert={}",
            postgres.port,
            pki.ca.display()
        )
    };
    let mut admin = sqlx::PgConnection::connect(&verified("postgres"))
        .await
        .expect("a verified TLS connection with the test's CA");
    sqlx::query("CREATE DATABASE sas")
        .execute(&mut admin)
        .await
        .unwrap();

    let broker = TlsProxy::start(&cert_pem, &key_pem, "127.0.0.1:5672".parse().unwrap()).await;
    let amqp = env.amqp_url.replacen("amqp://", "amqps://", 1).replacen(
        ":5672",
        &format!(":{}", broker.port),
        1,
    );
    assert!(amqp.contains(&format!(":{}", broker.port)), "{amqp}");
    let tls = [
        Setting::AmqpUrl(amqp),
        Setting::Raw("SAS_AMQP__TLS_CA_FILE", pki.ca.display().to_string()),
        Setting::DatabaseUrl(format!(
            "postgres://postgres@127.0.0.1:{}/sas",
            postgres.port
        )),
        Setting::Raw("SAS_DATABASE__SSL_MODE", "verify-full".into()),
        Setting::Raw("SAS_DATABASE__SSL_ROOT_CERT", pki.ca.display().to_string()),
    ];
    let https = [
        Setting::Raw("SAS_HTTP__TLS_CERT_FILE", pki.cert.display().to_string()),
        Setting::Raw("SAS_HTTP__TLS_KEY_FILE", pki.key.display().to_string()),
    ];
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &tls);
    let _scheduler = env.scheduler(0, &tls);
    let _supervisor = env.supervisor(0, &tls);
    let port = free_port();
    let mut gateway = tls.to_vec();
    gateway.extend(https.iter().cloned());
    gateway.extend([
        Setting::Listen(port),
        Setting::GatewayClients(format!("shop:{}", hash_secret("gateway", SECRET).unwrap())),
    ]);
    let _gateway = env.spawn("gateway", "gateway", &gateway);
    let console_port = free_port();
    let mut console = tls.to_vec();
    console.extend(https.iter().cloned());
    console.extend([
        Setting::Listen(console_port),
        Setting::ConsoleUsers(sas_lab::console::users()),
    ]);
    let _console = env.spawn("console", "console", &console);

    sas_lab::install_crypto_provider();
    let client = reqwest::Client::builder()
        .tls_backend_rustls()
        .tls_certs_only([reqwest::Certificate::from_pem(pki.ca_pem.as_bytes()).unwrap()])
        .build()
        .unwrap();
    let base = format!("https://127.0.0.1:{port}");
    for (what, url) in [
        ("the gateway", format!("{base}/readyz")),
        (
            "the console",
            format!("https://127.0.0.1:{console_port}/readyz"),
        ),
    ] {
        wait_until(
            &format!("{what} ready over HTTPS"),
            Duration::from_secs(30),
            || async {
                match client.get(&url).send().await {
                    Ok(response) if response.status() == StatusCode::OK => Ok(()),
                    Ok(response) => Err(format!("{}", response.status())),
                    Err(error) => Err(format!("{error:#}")),
                }
            },
        )
        .await;
    }
    // What compose's health checks run, with and without the CA.
    let https = format!("https://127.0.0.1:{console_port}/readyz");
    let ca = pki.ca.display().to_string();
    let (code, _) = env.sasctl(&["probe", "--ca-file", &ca, &https]).await;
    assert_eq!(code, 0, "sasctl probe --ca-file {ca} {https}");
    let (code, _) = env.sasctl(&["probe", &https]).await;
    assert_ne!(code, 0, "an https:// probe without a CA");
    // Plain HTTP on the same port gets no HTTP answer.
    let plain = sas_tests::http_client()
        .get(format!("http://127.0.0.1:{port}/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP answered: {plain:?}");

    let submitted = serde_json::to_value(order("ord-tls-1")).unwrap();
    let accepted = client
        .post(format!("{base}/v1/orders"))
        .bearer_auth(SECRET)
        .json(&submitted)
        .send()
        .await
        .expect("the gateway answers over HTTPS");
    assert_eq!(accepted.status(), StatusCode::ACCEPTED);
    let outcome: Value = client
        .get(format!("{base}/v1/orders/ord-tls-1?wait=30"))
        .bearer_auth(SECRET)
        .send()
        .await
        .expect("the gateway answers over HTTPS")
        .json()
        .await
        .unwrap();
    assert_eq!(outcome["outcome"], "processed", "{outcome}");

    // Every service connection to the database is encrypted (the cluster
    // takes no other), and every service came in through the TLS front.
    let (connections, encrypted): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE s.ssl)
           FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
          WHERE a.datname = 'sas' AND a.backend_type = 'client backend'",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert!(connections >= 4, "{connections} connections to sas");
    assert_eq!(encrypted, connections);
    assert!(
        broker.handshakes() >= 6,
        "{} TLS handshakes at the broker's front: every service (3 agents, a scheduler, a supervisor, the gateway, the console) connects through it",
        broker.handshakes()
    );
}
