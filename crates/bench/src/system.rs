//! The system under test, as local processes, and reading their memory.

use std::collections::BTreeMap;

use sas_lab::process::{free_port, Service};
use sas_lab::sim::SimClient;
use sas_lab::Setting;
use sas_lab::TestEnv;

/// Settings every benchmarked service gets: quiet logs (an info line per
/// message costs throughput), fast supervisor.
pub fn quiet() -> Vec<Setting> {
    let mut vars = vec![Setting::LogFilter("warn".to_owned())];
    vars.extend(EXTRA.get().cloned().unwrap_or_default());
    vars
}

/// Settings given with `--set`, passed to every service (each reads the
/// sections it has): for tuning experiments.
pub static EXTRA: std::sync::OnceLock<Vec<Setting>> = std::sync::OnceLock::new();

/// The running system.
pub struct BenchSystem {
    /// remote-sim.
    pub sim_process: Service,
    /// Its client.
    pub sim: SimClient,
    /// Agent processes, each serving all three queues.
    pub agents: Vec<Service>,
    /// Their metrics ports.
    pub agent_ports: Vec<u16>,
    /// The scheduler.
    pub scheduler: Service,
    /// The scheduler's metrics port.
    pub scheduler_port: u16,
    /// The supervisor.
    pub supervisor: Service,
}

impl BenchSystem {
    /// Starts remote-sim, `agents` agent processes (each on all three
    /// queues), one scheduler and one supervisor.
    pub async fn start(env: &TestEnv, agents: usize) -> Self {
        // No body per call in the ledger: the benchmark measures memory.
        let mut sim_settings = quiet();
        sim_settings.push(Setting::SimRecordBodies(false));
        let (sim_process, sim) = env.remote_sim(&sim_settings).await;
        let agent_ports: Vec<u16> = (0..agents).map(|_| free_port()).collect();
        let agents = agent_ports
            .iter()
            .enumerate()
            .map(|(index, &port)| start_agent(env, &sim, index, &[Setting::Listen(port)]))
            .collect();
        let scheduler_port = free_port();
        let mut vars = quiet();
        vars.push(Setting::Listen(scheduler_port));
        let scheduler = env.scheduler(0, &vars);
        let supervisor = env.supervisor(0, &quiet());
        Self {
            sim_process,
            sim,
            agents,
            agent_ports,
            scheduler,
            scheduler_port,
            supervisor,
        }
    }

    /// Every process with the binary it runs.
    pub fn processes(&self) -> Vec<(&'static str, u32)> {
        let mut all = vec![
            ("remote-sim", self.sim_process.pid()),
            ("scheduler", self.scheduler.pid()),
            ("supervisor", self.supervisor.pid()),
        ];
        all.extend(self.agents.iter().map(|agent| ("agent", agent.pid())));
        all
    }
}

/// Starts agent process `index` serving all three queues.
pub fn start_agent(env: &TestEnv, sim: &SimClient, index: usize, extra: &[Setting]) -> Service {
    let mut vars = quiet();
    vars.push(Setting::AgentName("inventory,payment,shipping".to_owned()));
    vars.push(Setting::AgentId(format!("agent-{index}")));
    vars.push(Setting::AgentRemoteUrl(format!(
        "{}/{{agent}}",
        sim.base_url()
    )));
    vars.extend(extra.iter().cloned());
    env.spawn("agent", &format!("agent-{index}"), &vars)
}

/// (resident, peak resident) memory of a process, in MiB, from /proc.
pub fn memory_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|line| line.starts_with(name))
            .and_then(|line| line.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// CPU time (user + system) used so far by every process of the machine,
/// summed by program: the services by binary name, and the machine's
/// `postgres` and RabbitMQ (`beam.smp`) processes, which the benchmark does
/// not own but loads. Differences of two samples say where the time went.
pub fn cpu_secs_by_program() -> BTreeMap<String, f64> {
    // Clock ticks per second: 100 on every Linux this runs on.
    const TICKS: f64 = 100.0;
    let mut by_program = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return by_program;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // comm is in parentheses and may hold spaces; the fields follow it.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let program = match &stat[open + 1..close] {
            "beam.smp" => "rabbitmq",
            other => other,
        };
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        let ticks = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        // utime and stime are fields 14 and 15 of stat, 12 and 13 after comm.
        *by_program.entry(program.to_owned()).or_default() += (ticks(11) + ticks(12)) / TICKS;
    }
    by_program
}
