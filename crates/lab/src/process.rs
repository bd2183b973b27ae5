//! Running the real binaries as processes, and killing them the way
//! production does (SIGTERM from an orchestrator, kill -9 from the OOM killer).

use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

use crate::settings::Setting;
use crate::sim::SimClient;
use crate::TestEnv;

pub use crate::env::bin_dir;

/// One running service process; killed (SIGKILL) if dropped while running.
pub struct Service {
    /// Name used for its log file.
    pub name: String,
    /// Log file (stdout and stderr).
    pub log: PathBuf,
    binary: String,
    settings: Vec<Setting>,
    child: Child,
}

impl Service {
    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// kill -9: no chance to clean up, as when a machine or the OOM killer takes it.
    pub async fn kill9(&mut self) {
        let _ = self.child.kill().await;
    }

    /// SIGTERM, then waits for the exit (SIGKILL after `timeout`).
    ///
    /// # Panics
    /// When the process does not exit in time.
    pub async fn terminate(&mut self, timeout: Duration) -> ExitStatus {
        if let Some(pid) = self.child.id() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
        }
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => status.expect("wait"),
            Err(_) => {
                let _ = self.child.kill().await;
                panic!(
                    "{} did not exit within {timeout:?} of SIGTERM (log: {})",
                    self.name,
                    self.log.display()
                );
            }
        }
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Where [`free_port`] looks: below Linux's ephemeral range (32768 to
/// 60999 by default), from which the kernel picks the local port of every
/// outgoing connection and of a bind to port 0.
const TEST_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A free TCP port on localhost for a service a test starts.
///
/// Not one the kernel would hand out by itself: a port taken by binding to
/// port 0 and released is in the ephemeral range, where any connection
/// made meanwhile may take it, and where the next bind to port 0 (another
/// test's) may get it again. A service then failed to listen ("Address
/// already in use") while the test talked to another test's service on
/// that port. The ports here are handed out in turn by one counter per
/// process (starting at an offset from the process id), each checked free.
///
/// # Panics
/// When every port of the range is taken.
pub fn free_port() -> u16 {
    static NEXT: std::sync::OnceLock<std::sync::atomic::AtomicU32> = std::sync::OnceLock::new();
    let span = u32::from(TEST_PORTS.end - TEST_PORTS.start);
    let next = NEXT.get_or_init(|| std::sync::atomic::AtomicU32::new(std::process::id() % span));
    for _ in 0..span {
        let offset = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % span;
        let port = TEST_PORTS.start + u16::try_from(offset).expect("offset below the span");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {TEST_PORTS:?} on 127.0.0.1");
}

impl TestEnv {
    /// What every service of this deployment gets: the test's database and
    /// prefix, fast reconnects and scans, and deadline margins in proportion
    /// to the test's step deadline (the defaults suit deadlines of seconds).
    pub fn base_settings(&self) -> Vec<Setting> {
        vec![
            Setting::AmqpUrl(self.amqp_url.clone()),
            Setting::AmqpPrefix(self.prefix.clone()),
            Setting::AmqpReconnectBaseMs(100),
            Setting::AmqpReconnectMaxMs(1000),
            Setting::AmqpOperationTimeoutMs(5000),
            // The tests' queues (declared by `TestEnv::broker` too) keep a
            // delivery limit of 3, so that a poison message is dead-lettered
            // after four deliveries.
            Setting::AmqpDeliveryLimit(3),
            Setting::DatabaseUrl(self.database_url.clone()),
            Setting::DatabaseAcquireTimeoutMs(2000),
            Setting::Listen(0),
            Setting::LogFilter("info".into()),
            Setting::SchedulerWorkflowFile(self.workflow_file().display().to_string()),
            Setting::SchedulerClaimIntervalMs(100),
            Setting::SupervisorIntervalMs(200),
            Setting::SupervisorBackoffBaseMs(100),
            Setting::SupervisorBackoffMaxMs(1000),
        ]
        .into_iter()
        .chain(self.deadline_settings())
        .collect()
    }

    /// The deadline margins every service, and sasctl, of this deployment
    /// gets ([`crate::env::deadlines_for`]).
    pub fn deadline_settings(&self) -> [Setting; 3] {
        let deadlines = crate::env::deadlines_for(self.step_timeout_ms);
        [
            Setting::DeadlinesStartMarginMs(deadlines.start_margin_ms),
            Setting::DeadlinesGraceMs(deadlines.grace_ms),
            Setting::DeadlinesMaxClockSkewMs(deadlines.max_clock_skew_ms),
        ]
    }

    /// Starts `binary` with this test's [`TestEnv::base_settings`], then
    /// `settings` (a later setting of the same variable wins); logs go to
    /// `<dir>/<name>.log`.
    ///
    /// # Panics
    /// When the binary is not built or cannot start.
    pub fn spawn(&self, binary: &str, name: &str, settings: &[Setting]) -> Service {
        let path = bin_dir().join(binary);
        assert!(
            path.exists(),
            "{} is not built: run `cargo build --workspace --bins` first (scripts/test.sh does)",
            path.display()
        );
        let log = self.dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("log file");
        let mut command = Command::new(&path);
        for (key, _) in std::env::vars() {
            if key.starts_with("SAS_") {
                command.env_remove(key);
            }
        }
        for (key, value) in self
            .base_settings()
            .iter()
            .chain(settings)
            .map(Setting::var)
        {
            command.env(key, value);
        }
        command
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .kill_on_drop(true);
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", path.display()));
        Service {
            name: name.to_owned(),
            log,
            binary: binary.to_owned(),
            settings: settings.to_vec(),
            child,
        }
    }

    /// Starts `service` again with the same binary, name and settings (after
    /// killing it if it still runs), as an orchestrator restarts a crashed pod.
    pub async fn restart(&self, service: &mut Service) {
        service.kill9().await;
        let settings = std::mem::take(&mut service.settings);
        *service = self.spawn(&service.binary, &service.name, &settings);
    }

    /// Starts remote-sim on a free port (journaled in the test folder) and
    /// waits until it answers.
    ///
    /// # Panics
    /// When it does not answer within 10 seconds.
    pub async fn remote_sim(&self, settings: &[Setting]) -> (Service, SimClient) {
        let port = free_port();
        let mut all = vec![
            Setting::Listen(port),
            Setting::SimJournalFile(self.dir.join("sim-journal.jsonl").display().to_string()),
            // Tests check what a request template sent.
            Setting::SimRecordBodies(true),
        ];
        all.extend_from_slice(settings);
        let service = self.spawn("remote-sim", "remote-sim", &all);
        let sim = SimClient::new(port);
        crate::wait_until("remote-sim to answer", Duration::from_secs(10), || async {
            sim.stats().await.map(|_| ()).map_err(|e| e.to_string())
        })
        .await;
        (service, sim)
    }

    /// Starts replica `index` of agent `agent` (id `<agent>-<index>`) calling `sim`.
    pub fn agent(
        &self,
        agent: &str,
        index: usize,
        sim: &SimClient,
        settings: &[Setting],
    ) -> Service {
        let mut all = vec![
            Setting::AgentName(agent.to_owned()),
            Setting::AgentId(format!("{agent}-{index}")),
            Setting::AgentRemoteUrl(format!("{}/{agent}", sim.base_url())),
        ];
        all.extend_from_slice(settings);
        self.spawn("agent", &format!("agent-{agent}-{index}"), &all)
    }

    /// Starts scheduler `index` (id `scheduler-<index>`).
    pub fn scheduler(&self, index: usize, settings: &[Setting]) -> Service {
        let mut all = vec![Setting::SchedulerId(format!("scheduler-{index}"))];
        all.extend_from_slice(settings);
        self.spawn("scheduler", &format!("scheduler-{index}"), &all)
    }

    /// Starts supervisor `index` (id `supervisor-<index>`).
    pub fn supervisor(&self, index: usize, settings: &[Setting]) -> Service {
        let mut all = vec![Setting::SupervisorId(format!("supervisor-{index}"))];
        all.extend_from_slice(settings);
        self.spawn("supervisor", &format!("supervisor-{index}"), &all)
    }

    /// Starts a whole system: remote-sim, `replicas` agents per agent queue,
    /// one scheduler and one supervisor.
    pub async fn system(&self, replicas: usize) -> System {
        let (sim_process, sim) = self.remote_sim(&[]).await;
        let mut agents = Vec::new();
        for agent in crate::env::AGENTS {
            for index in 0..replicas {
                agents.push(self.agent(agent, index, &sim, &[]));
            }
        }
        System {
            schedulers: vec![self.scheduler(0, &[])],
            supervisors: vec![self.supervisor(0, &[])],
            agents,
            sim_process,
            sim,
        }
    }
}

/// Every process of a running system.
pub struct System {
    /// Scheduler processes.
    pub schedulers: Vec<Service>,
    /// Supervisor processes.
    pub supervisors: Vec<Service>,
    /// Agent processes.
    pub agents: Vec<Service>,
    /// The remote-sim process.
    pub sim_process: Service,
    /// A client of remote-sim.
    pub sim: SimClient,
}

impl System {
    /// Panics naming every process that has exited.
    ///
    /// # Panics
    /// When a process is no longer running.
    pub fn assert_all_running(&mut self) {
        let mut dead = Vec::new();
        for service in self
            .schedulers
            .iter_mut()
            .chain(self.supervisors.iter_mut())
            .chain(self.agents.iter_mut())
            .chain(std::iter::once(&mut self.sim_process))
        {
            if !service.is_running() {
                dead.push(format!("{} (log {})", service.name, service.log.display()));
            }
        }
        assert!(dead.is_empty(), "processes exited: {dead:?}");
    }
}

impl TestEnv {
    /// Starts `replicas` agents for each agent queue, calling `sim`, with `settings`.
    pub fn agents(&self, replicas: usize, sim: &SimClient, settings: &[Setting]) -> Vec<Service> {
        crate::env::AGENTS
            .iter()
            .flat_map(|agent| (0..replicas).map(move |index| (agent, index)))
            .map(|(agent, index)| self.agent(agent, index, sim, settings))
            .collect()
    }

    /// Runs `sasctl` against this test's deployment and returns its exit
    /// code and standard output.
    ///
    /// # Panics
    /// When sasctl cannot be started.
    pub async fn sasctl(&self, args: &[&str]) -> (i32, String) {
        let (code, stdout, _) = self.sasctl_with_errors(args).await;
        (code, stdout)
    }

    /// [`TestEnv::sasctl`], with its standard error too: what a refusal
    /// says.
    ///
    /// # Panics
    /// When sasctl cannot be started.
    pub async fn sasctl_with_errors(&self, args: &[&str]) -> (i32, String, String) {
        let output = Command::new(bin_dir().join("sasctl"))
            .args(args)
            .envs(
                [
                    Setting::AmqpUrl(self.amqp_url.clone()),
                    Setting::AmqpPrefix(self.prefix.clone()),
                    Setting::DatabaseUrl(self.database_url.clone()),
                ]
                .into_iter()
                .chain(self.deadline_settings())
                .map(|setting| setting.var()),
            )
            .stdin(Stdio::null())
            .output()
            .await
            .expect("run sasctl");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        eprintln!("sasctl {args:?}: {stdout}{stderr}");
        (output.status.code().unwrap_or(-1), stdout, stderr)
    }
}

/// Reads one sample of a Prometheus metric (`name{labels}` exactly as
/// rendered) from a service's `/metrics` on `port`.
pub async fn metric(port: u16, sample: &str) -> Option<f64> {
    let text = crate::http_get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    sample_in(&text, sample)
}

/// The value of one sample in a Prometheus text exposition, such as a
/// whole `/metrics` page: a test that compares two samples reads both from
/// one scrape, since the next scrape may already tell another moment.
pub fn sample_in(text: &str, sample: &str) -> Option<f64> {
    text.lines()
        .find(|line| line.starts_with(sample) && line[sample.len()..].starts_with(' '))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
}

/// Waits until one sample of a Prometheus metric on `port` (as [`metric`]
/// reads it) has a value `accept` takes, and returns that value; a sample
/// not (yet) exported never counts.
///
/// # Panics
/// When none has by `timeout`, naming `what` and the last value seen.
pub async fn wait_for_metric(
    what: &str,
    port: u16,
    sample: &str,
    timeout: Duration,
    accept: impl Fn(f64) -> bool,
) -> f64 {
    crate::wait_until(what, timeout, || async {
        match metric(port, sample).await {
            Some(value) if accept(value) => Ok(value),
            other => Err(format!("{sample}: {other:?}")),
        }
    })
    .await
}

/// What `<binary> hash-secret` (the console's, the gateway's) prints for
/// `secret` on its standard input, or its exit code and error.
///
/// # Panics
/// When the binary is not built.
pub fn hash_secret(binary: &str, secret: &str) -> Result<String, (Option<i32>, String)> {
    use std::io::Write as _;
    let mut child = std::process::Command::new(bin_dir().join(binary))
        .arg("hash-secret")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("run {binary} hash-secret (cargo build --workspace --bins builds it): {e}")
        });
    writeln!(child.stdin.take().expect("stdin"), "{secret}").expect("write the secret");
    let out = child.wait_with_output().expect("its output");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err((
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    }
}
