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
    /// A bad configuration value.
    Config(String),
    /// A bad argument (a misaligned or null buffer, a call out of order).
    Invalid(String),
    /// A key that the store does not hold (freed already, or never put).
    UnknownKey(u64),
    /// The entry is held by another call (acquired, or being filled): `what` says by what.
    Busy { key: u64, what: &'static str },
    /// A device's I/O engine stopped (its ring failed, or its thread died): this
    /// transfer did not happen.
    EngineFailed { path: PathBuf, detail: String },
    /// A transfer the caller made outside the store (`end_external`) failed, as it says.
    External(String),
    /// The store refuses new work since an earlier failure, which `0` describes.
    Failed(String),
    /// The store was used after `close()`.
    Closed,
    /// A store or ticket made before fork() was used in the child.
    Forked,
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
            Error::EngineFailed { .. } | Error::Failed(_) | Error::External(_) => Some(libc::EIO),
            _ => None,
        }
    }

    /// The message without the path, for callers that report the path apart
    /// (Python's `OSError` prints `[Errno N] message: 'path'`).
    pub fn message_without_path(&self) -> String {
        match self {
            Error::Io { op, offset, len, errno, .. } => io_message(op, *offset, *len, *errno, None),
            other => other.to_string(),
        }
    }

    pub fn last_os(op: &'static str, path: impl Into<PathBuf>, offset: u64, len: u64) -> Self {
        let errno = io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
        Error::io(op, path, offset, len, errno)
    }
}

/// "read of 4096 bytes at offset 0 in /dir failed: Input/output error", or for an
/// operation on a path ("open", "mkdir"), "open of /dir failed: Not a directory".
fn io_message(op: &str, offset: u64, len: u64, errno: i32, path: Option<&std::path::Path>) -> String {
    let what = match (op, path) {
        ("read" | "write", Some(p)) => format!("{op} of {len} bytes at offset {offset} in {}", p.display()),
        ("read" | "write", None) => format!("{op} of {len} bytes at offset {offset}"),
        (_, Some(p)) => format!("{op} of {}", p.display()),
        (_, None) => op.to_string(),
    };
    format!("{what} failed: {}{}", strerror(errno), errno_hint(op, errno))
}

/// The system's text for `errno`, without Rust's " (os error N)" suffix.
fn strerror(errno: i32) -> String {
    let text = io::Error::from_raw_os_error(errno).to_string();
    match text.rfind(" (os error ") {
        Some(i) => text[..i].to_string(),
        None => text,
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
                f.write_str(&io_message(op, *offset, *len, *errno, Some(path)))
            }
            Error::OutOfSpace { needed, detail } => {
                write!(f, "no space for {needed} bytes: {detail}")
            }
            Error::Config(msg) | Error::Invalid(msg) => f.write_str(msg),
            Error::UnknownKey(k) => write!(f, "unknown key {k} (freed already, or never put)"),
            Error::Busy { key, what } => write!(f, "entry {key} is busy: {what}"),
            Error::EngineFailed { path, detail } => write!(f, "the I/O engine of {} failed: {detail}", path.display()),
            Error::External(why) => write!(f, "a transfer outside the store failed: {why}"),
            Error::Failed(why) => write!(f, "the store refuses new work after a failure: {why}"),
            Error::Closed => f.write_str("the store is closed"),
            Error::Forked => f.write_str(
                "this store was made before fork(): a forked child cannot use it (make a new one, or attach again, in the child)",
            ),
        }
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_operation_once_and_the_path_where_asked() {
        let read = Error::io("read", "/ssd/a", 8192, 4096, libc::EIO);
        assert_eq!(read.to_string(), "read of 4096 bytes at offset 8192 in /ssd/a failed: Input/output error");
        assert_eq!(read.message_without_path(), "read of 4096 bytes at offset 8192 failed: Input/output error");
        let open = Error::io("open", "/ssd/f", 0, 0, libc::ENOTDIR);
        assert_eq!(open.to_string(), "open of /ssd/f failed: Not a directory");
        let write = Error::io("write", "/ssd/a", 0, 512, libc::EINVAL);
        assert!(write.message_without_path().ends_with("(misaligned buffer, offset or length for O_DIRECT?)"));
        assert_eq!(Error::Closed.message_without_path(), "the store is closed");
        let dead = Error::EngineFailed { path: "/ssd".into(), detail: "its thread panicked".into() };
        assert_eq!(dead.errno(), Some(libc::EIO));
        assert_eq!(
            Error::Failed(dead.to_string()).to_string(),
            "the store refuses new work after a failure: the I/O engine of /ssd failed: its thread panicked"
        );
    }
}
