//! jemalloc as the allocator of the services that carry the load.
//!
//! Under load, glibc's malloc cost the scheduler and the agents about a
//! tenth of their CPU, most of it on blocks larger than its per-thread
//! cache takes (1 KiB: task futures, message bodies and properties, JSON),
//! which go through the shared arena, its locks and its consolidation of
//! freed chunks. jemalloc serves those from per-thread caches too: side by
//! side, the two services used 12 to 13% less CPU per order, for under
//! 1 MiB more at peak (docs/performance.md, "The allocator"). mimalloc,
//! measured the same way, saved nothing and took half as much memory again.

/// The allocator [`use_jemalloc!`] installs.
pub use tikv_jemallocator::Jemalloc;

/// Makes jemalloc the allocator of the binary that invokes it (once, at the
/// top level of its `main.rs`), with one arena (each thread keeps its own
/// cache in front of it, and the services run a handful of threads), so
/// that a service's memory stays what it was with glibc, and free pages
/// returned to the system after a second.
#[macro_export]
macro_rules! use_jemalloc {
    () => {
        #[global_allocator]
        static ALLOCATOR: $crate::allocator::Jemalloc = $crate::allocator::Jemalloc;

        /// Read by jemalloc as it starts (its `malloc_conf`, under the
        /// prefix of tikv-jemalloc-sys's symbols).
        #[export_name = "_rjem_malloc_conf"]
        static JEMALLOC_CONF: &[u8; 47] = b"narenas:1,dirty_decay_ms:1000,muzzy_decay_ms:0\0";
    };
}
