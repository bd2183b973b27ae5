//! The lock that lets one process at a time apply the migrations, taken
//! without blocking inside Postgres.
//!
//! sqlx's migrator waits in `pg_advisory_lock`, a statement that holds a
//! snapshot while it waits. A migration that builds an index
//! `CONCURRENTLY` (0011) waits for every older snapshot in the database,
//! so two services starting together deadlock: one waits for the lock, the
//! other for the waiter's snapshot. Postgres breaks the cycle after
//! `deadlock_timeout`, and the retries cost seconds a start, more under
//! load. Asking with `pg_try_advisory_lock` between short sleeps holds no
//! snapshot while waiting.

use std::time::Duration;

use sqlx::PgConnection;

/// How long a process waits between two asks for the lock.
const ASK_EVERY: Duration = Duration::from_millis(100);

/// The advisory lock id sqlx uses for a database (sqlx-postgres's
/// `generate_lock_id`), so that a process of an older release, migrating
/// with sqlx's own lock, and one of this release exclude each other.
pub(crate) fn lock_id(database: &str) -> i64 {
    const CRC_IEEE: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISO_HDLC);
    0x3d32_ad9e * i64::from(CRC_IEEE.checksum(database.as_bytes()))
}

/// Takes the session's migration lock on `connection`'s database, asking
/// again every [`ASK_EVERY`] while another process holds it.
///
/// # Errors
/// When the database fails.
pub(crate) async fn lock(connection: &mut PgConnection) -> Result<i64, sqlx::Error> {
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut *connection)
        .await?;
    let id = lock_id(&database);
    while !sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_lock($1)")
        .bind(id)
        .fetch_one(&mut *connection)
        .await?
    {
        tokio::time::sleep(ASK_EVERY).await;
    }
    Ok(id)
}

/// Gives the lock back.
///
/// # Errors
/// When the database fails (the lock then goes with the session).
pub(crate) async fn unlock(connection: &mut PgConnection, id: i64) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(id)
        .execute(connection)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::lock_id;

    #[test]
    fn the_lock_id_is_sqlx_s_for_the_same_database() {
        // 0x3d32ad9e times the CRC-32 of "postgres" (0x156a8775, as
        // Python's zlib.crc32 computes it), as sqlx-postgres 0.9 does.
        assert_eq!(lock_id("postgres"), 368_907_709_894_077_238);
    }
}
