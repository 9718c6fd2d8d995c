//! The state store on files: [`FileStore`], a snapshot and a journal under the data
//! directory, implementing [`stanch_ports::store::StateStore`].
//!
//! Its file operations go through the [`fs::Fs`] seam, so tests can fail any one of
//! them (`sim`, feature `fault-injection`).

mod file;
pub mod fs;
#[cfg(feature = "fault-injection")]
pub mod sim;

pub use file::FileStore;
