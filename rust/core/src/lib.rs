//! ssdtier-core: the mechanism under ssdtier. A tiered byte store with a host
//! arena (one page-aligned mapping) and NVMe files written with O_DIRECT
//! through io_uring (or a POSIX thread pool). It knows bytes, never tensors.

pub mod alloc;
pub mod arena;
pub mod device;
pub mod engine;
pub mod error;
pub mod fork;
pub mod sim;
pub mod store;
pub mod ticket;

pub use device::ALIGN;
pub use error::{Error, Result};
pub use store::{Backend, DeviceConfig, Eviction, Extent, Stats, Store, StoreConfig};
pub use ticket::{Owner, Ticket};
