//! Errors of the core, with the context that makes them actionable.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// What went wrong, with enough context to act on it (op, path, offset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// An operating-system error on a file of the store.
    Io { op: &'static str, path: PathBuf, offset: u64, len: u64, errno: i32 },
    /// Every tier that could take the bytes is full.
    OutOfSpace { needed: u64, detail: String },
    /// A bad argument or configuration value.
    Invalid(String),
    /// A key that the store does not hold (freed already, or never put).
    UnknownKey(u64),
    /// The store was used after `close()`.
    Closed,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(op: &'static str, path: impl Into<PathBuf>, offset: u64, len: u64, errno: i32) -> Self {
        Error::Io { op, path: path.into(), offset, len, errno }
    }

    /// The errno to report for this error, where one applies.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Io { errno, .. } => Some(*errno),
            Error::OutOfSpace { .. } => Some(libc::ENOSPC),
            _ => None,
        }
    }

    pub fn last_os(op: &'static str, path: impl Into<PathBuf>, offset: u64, len: u64) -> Self {
        let errno = io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
        Error::io(op, path, offset, len, errno)
    }
}

/// A short explanation for the errnos that O_DIRECT and full disks produce.
fn errno_hint(op: &str, errno: i32) -> &'static str {
    match errno {
        libc::EINVAL if op != "open" => " (misaligned buffer, offset or length for O_DIRECT?)",
        libc::ENOSPC => " (the file system is full)",
        libc::EDQUOT => " (disk quota exceeded)",
        libc::EROFS => " (read-only file system)",
        _ => "",
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { op, path, offset, len, errno } => {
                let msg = io::Error::from_raw_os_error(*errno);
                write!(
                    f,
                    "{op} of {len} bytes at offset {offset} in {}: {msg}{}",
                    path.display(),
                    errno_hint(op, *errno)
                )
            }
            Error::OutOfSpace { needed, detail } => {
                write!(f, "no space for {needed} bytes: {detail}")
            }
            Error::Invalid(msg) => f.write_str(msg),
            Error::UnknownKey(k) => write!(f, "unknown key {k} (freed already, or never put)"),
            Error::Closed => f.write_str("the store is closed"),
        }
    }
}

impl std::error::Error for Error {}
