//! jemalloc as the allocator of the services that carry the load.
//!
//! Under load, glibc's malloc family took a fifth of the scheduler's and
//! the agents' CPU samples, much of it in the paths glibc takes for blocks
//! its per-thread cache does not hold (over 1,032 bytes: `_int_malloc`,
//! `malloc_consolidate`, `unlink_chunk`). jemalloc serves those from
//! per-thread caches too: side by side, in two sittings, the two services
//! used 13% and 14% less CPU per order together (medians), for 0.3 to
//! 1.9 MiB more at peak and 1.3 to 3.2 MiB more idle (docs/performance.md,
//! "The allocator"). mimalloc, measured the same way, saved nothing and
//! took two thirds more memory.
//!
//! Its settings are compiled into it (`JEMALLOC_SYS_WITH_MALLOC_CONF` in
//! `.cargo/config.toml`): one arena, unused pages given back after a second.

/// The allocator [`use_jemalloc!`](crate::use_jemalloc) installs.
pub use tikv_jemallocator::Jemalloc;

/// Makes jemalloc the allocator of the binary that invokes it (once, at the
/// top level of its `main.rs`).
#[macro_export]
macro_rules! use_jemalloc {
    () => {
        #[global_allocator]
        static ALLOCATOR: $crate::allocator::Jemalloc = $crate::allocator::Jemalloc;
    };
}
