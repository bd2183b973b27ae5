//! A throwaway Postgres primary and its streaming standby, for tests of what
//! a failover does to the services: two clusters of the machine's own
//! Postgres binaries (`initdb`, `pg_basebackup -R`) in a folder of their own,
//! on free ports of 127.0.0.1, stopped and removed when dropped. Also one
//! cluster that takes TLS connections only ([`TlsPostgres`]).
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
        start_cluster(&self.bin, &self.dir, name, port, "");
    }

    /// Runs one of the Postgres binaries, and panics unless it succeeds.
    fn postgres(&self, binary: &str, args: &[&str]) {
        run(postgres_command(&self.bin, binary)
            .args(args)
            .current_dir(&self.dir));
    }
}

/// A throwaway Postgres that takes TLS connections only (`hostssl`, the
/// certificate given), for the services' `verify-full` side: stopped and
/// removed when dropped.
pub struct TlsPostgres {
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: PathBuf,
    bin: PathBuf,
}

impl TlsPostgres {
    /// Makes a cluster whose only way in is TLS with the PEM certificate
    /// `cert_pem` and key `key_pem` (trust authentication inside it), and
    /// starts it.
    ///
    /// # Panics
    /// When the Postgres binaries are missing or a command fails.
    pub fn start(cert_pem: &str, key_pem: &str) -> Self {
        let bin = postgres_bin();
        let dir =
            std::env::temp_dir().join(format!("sas-pg-tls-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("create the cluster's folder");
        if is_root() {
            run(Command::new("chown").arg("postgres:postgres").arg(&dir));
        }
        let data = dir.join("tls");
        run(postgres_command(&bin, "initdb")
            .args(["-A", "trust", "-U", "postgres", "-D"])
            .arg(&data)
            .current_dir(&dir));
        std::fs::write(data.join("server.crt"), cert_pem).expect("write the certificate");
        std::fs::write(data.join("server.key"), key_pem).expect("write the key");
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
        )
        .expect("write pg_hba.conf");
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(
                data.join("server.key"),
                std::fs::Permissions::from_mode(0o600),
            )
            .expect("the key's mode");
        }
        if is_root() {
            run(Command::new("chown")
                .arg("-R")
                .arg("postgres:postgres")
                .arg(&dir));
        }
        let port = free_port();
        start_cluster(&bin, &dir, "tls", port, " -c ssl=on");
        Self { port, dir, bin }
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        let _ = postgres_command(&self.bin, "pg_ctl")
            .args([
                "-D",
                path(&self.dir.join("tls")),
                "-m",
                "immediate",
                "-w",
                "stop",
            ])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts cluster `name` (its data in `dir/name`) on `port` with `options`
/// beside the usual ones, and waits until it takes connections.
fn start_cluster(bin: &Path, dir: &Path, name: &str, port: u16, options: &str) {
    let data = dir.join(name);
    let log = dir.join(format!("{name}.log"));
    let options = format!(
        "-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c fsync=off{options}",
        dir.display()
    );
    run(postgres_command(bin, "pg_ctl")
        .args([
            "-D",
            path(&data),
            "-l",
            path(&log),
            "-o",
            &options,
            "-w",
            "start",
        ])
        .current_dir(dir));
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
