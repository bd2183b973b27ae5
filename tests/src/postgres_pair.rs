//! A throwaway Postgres primary and its streaming standby, for tests of what
//! a failover does to the services: two clusters of the machine's own
//! Postgres binaries (`initdb`, `pg_basebackup -R`) in a folder of their own,
//! on free ports of 127.0.0.1, stopped and removed when dropped.
//!
//! Postgres refuses to run as root: when the tests run as root, every
//! command runs as the `postgres` user (Debian's packages create it).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::process::free_port;

/// A primary on `primary_port` and a hot standby of it on `standby_port`.
pub struct PostgresPair {
    /// The primary's port.
    pub primary_port: u16,
    /// The standby's port.
    pub standby_port: u16,
    dir: PathBuf,
    bin: PathBuf,
}

impl PostgresPair {
    /// Makes a primary, starts it, makes a standby of it with
    /// `pg_basebackup -R` (streaming replication, trust on 127.0.0.1), and
    /// starts that too.
    ///
    /// # Panics
    /// When the Postgres binaries are missing or a command fails (its output is in the panic).
    pub fn start() -> Self {
        let bin = postgres_bin();
        let dir =
            std::env::temp_dir().join(format!("sas-pg-pair-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("create the clusters' folder");
        if is_root() {
            run(Command::new("chown").arg("postgres:postgres").arg(&dir));
        }
        let pair = Self {
            primary_port: free_port(),
            standby_port: free_port(),
            dir,
            bin,
        };
        let primary = pair.dir.join("primary");
        pair.postgres(
            "initdb",
            &["-A", "trust", "-U", "postgres", "-D", path(&primary)],
        );
        pair.start_cluster("primary", pair.primary_port);
        let standby = pair.dir.join("standby");
        let port = pair.primary_port.to_string();
        pair.postgres(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-X",
                "stream",
                "-R",
                "-D",
                path(&standby),
            ],
        );
        pair.start_cluster("standby", pair.standby_port);
        pair
    }

    /// A URL of database `database` on the primary.
    pub fn primary_url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}",
            self.primary_port
        )
    }

    /// A URL of database `database` on the standby.
    pub fn standby_url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}",
            self.standby_port
        )
    }

    /// Stops the primary at once (`pg_ctl stop -m immediate`: no checkpoint,
    /// every connection cut), as a crash does.
    pub fn crash_primary(&self) {
        let data = self.dir.join("primary");
        self.postgres(
            "pg_ctl",
            &["-D", path(&data), "-m", "immediate", "-w", "stop"],
        );
    }

    /// Stops the standby (a fast shutdown): what the primary commits from
    /// now on is on the primary alone.
    pub fn stop_standby(&self) {
        let data = self.dir.join("standby");
        self.postgres("pg_ctl", &["-D", path(&data), "-m", "fast", "-w", "stop"]);
    }

    /// Starts the standby again (after [`PostgresPair::stop_standby`]).
    pub fn start_standby(&self) {
        self.start_cluster("standby", self.standby_port);
    }

    /// Promotes the standby to primary, and waits until it takes writes.
    pub fn promote_standby(&self) {
        let data = self.dir.join("standby");
        self.postgres("pg_ctl", &["-D", path(&data), "-w", "promote"]);
    }

    fn start_cluster(&self, name: &str, port: u16) {
        let data = self.dir.join(name);
        let log = self.dir.join(format!("{name}.log"));
        let options = format!(
            "-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c fsync=off",
            self.dir.display()
        );
        self.postgres(
            "pg_ctl",
            &[
                "-D",
                path(&data),
                "-l",
                path(&log),
                "-o",
                &options,
                "-w",
                "start",
            ],
        );
    }

    /// Runs one of the Postgres binaries, and panics unless it succeeds.
    fn postgres(&self, binary: &str, args: &[&str]) {
        run(postgres_command(&self.bin, binary)
            .args(args)
            .current_dir(&self.dir));
    }
}

impl Drop for PostgresPair {
    fn drop(&mut self) {
        for name in ["standby", "primary"] {
            let data = self.dir.join(name);
            if data.join("postmaster.pid").exists() {
                let _ = postgres_command(&self.bin, "pg_ctl")
                    .args(["-D", path(&data), "-m", "immediate", "-w", "stop"])
                    .output();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The folder of the newest Postgres binaries Debian installed
/// (`/usr/lib/postgresql/<version>/bin`).
fn postgres_bin() -> PathBuf {
    let mut versions: Vec<u32> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("Debian's Postgres binaries under /usr/lib/postgresql (scripts/services.sh installs them)")
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    versions.sort_unstable();
    let version = versions
        .last()
        .expect("a Postgres version under /usr/lib/postgresql");
    PathBuf::from(format!("/usr/lib/postgresql/{version}/bin"))
}

/// One of the Postgres binaries in `bin`, run as `postgres` when we are root.
fn postgres_command(bin: &Path, binary: &str) -> Command {
    let program = bin.join(binary);
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn path(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 temporary path")
}

fn run(command: &mut Command) {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed ({}): {}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
