//! One file per NVMe directory: nameless (`O_TMPFILE`), private (0600) and
//! opened with `O_DIRECT`, with clear fallbacks where the file system refuses.

use crate::error::{Error, Result};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// Buffer address, file offset and length of every direct transfer are
/// multiples of this. 4096 covers devices with 512-byte and 4 KiB logical blocks.
pub const ALIGN: u64 = 4096;

/// An open backing file of the NVMe tier.
pub struct DeviceFile {
    fd: OwnedFd,
    pub dir: PathBuf,
    /// Opened with O_DIRECT (false after a fallback, or when direct I/O is off).
    pub direct: bool,
    /// Nameless from the start (O_TMPFILE); false means a named file unlinked at once.
    pub tmpfile: bool,
}

impl DeviceFile {
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The file's current size in bytes.
    pub fn size(&self) -> u64 {
        // Safety: fstat on an fd we own into a zeroed stat buffer.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(self.fd.as_raw_fd(), &mut st) == 0 {
                st.st_size as u64
            } else {
                0
            }
        }
    }

    /// Open the backing file in `dir`, creating the directory (mode 0700) if needed.
    /// Fallbacks are reported through `notices`, one line each.
    pub fn open(dir: &Path, want_direct: bool, notices: &mut Vec<String>) -> Result<Self> {
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| Error::io("mkdir", dir, 0, 0, e.raw_os_error().unwrap_or(libc::EIO)))?;
        } else if !dir.is_dir() {
            return Err(Error::io("open", dir, 0, 0, libc::ENOTDIR));
        }
        let cdir = CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| Error::Invalid(format!("path {} contains a NUL byte", dir.display())))?;

        let mut direct = want_direct;
        let mut tmpfile = true;
        let fd = match open_tmpfile(&cdir, direct) {
            Ok(fd) => fd,
            Err(e) if direct && e == libc::EINVAL => match open_tmpfile(&cdir, false) {
                // The file system takes O_TMPFILE but refuses O_DIRECT (tmpfs does this).
                Ok(fd) => {
                    direct = false;
                    notices.push(format!(
                        "O_DIRECT is not supported in {}; using buffered I/O there (data goes through the page cache)",
                        dir.display()
                    ));
                    fd
                }
                Err(_) => open_fallback(dir, &mut direct, &mut tmpfile, notices)?,
            },
            Err(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL) => {
                open_fallback(dir, &mut direct, &mut tmpfile, notices)?
            }
            Err(e) => return Err(Error::io("open", dir, 0, 0, e)),
        };
        let mut file = DeviceFile { fd, dir: dir.to_path_buf(), direct, tmpfile };
        if file.direct && !file.probe_direct_write() {
            // Some file systems (FUSE, a few network ones) open with O_DIRECT and then refuse the I/O.
            clear_direct(file.raw_fd());
            file.direct = false;
            notices.push(format!(
                "direct I/O was accepted but refused on write in {}; using buffered I/O there",
                dir.display()
            ));
        }
        Ok(file)
    }

    /// Write one aligned block at offset 0 and truncate back: true if O_DIRECT really works.
    fn probe_direct_write(&self) -> bool {
        let layout = std::alloc::Layout::from_size_align(ALIGN as usize, ALIGN as usize).unwrap();
        // Safety: the buffer is allocated, zeroed, used for one pwrite and freed here.
        unsafe {
            let buf = std::alloc::alloc_zeroed(layout);
            if buf.is_null() {
                std::alloc::handle_alloc_error(layout);
            }
            let n = libc::pwrite(self.raw_fd(), buf as *const libc::c_void, ALIGN as usize, 0);
            std::alloc::dealloc(buf, layout);
            libc::ftruncate(self.raw_fd(), 0);
            n == ALIGN as isize
        }
    }
}

fn open_tmpfile(cdir: &CString, direct: bool) -> std::result::Result<OwnedFd, i32> {
    let mut flags = libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC;
    if direct {
        flags |= libc::O_DIRECT;
    }
    // Safety: a valid NUL-terminated path; the fd is owned right away.
    let fd = unsafe { libc::open(cdir.as_ptr(), flags, 0o600 as libc::c_uint) };
    if fd < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO))
    } else {
        // Safety: fd is a fresh descriptor nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// No O_TMPFILE: create a uniquely named file (0600) and unlink it at once, so
/// it still has no name and its space is freed when the process ends.
fn open_fallback(dir: &Path, direct: &mut bool, tmpfile: &mut bool, notices: &mut Vec<String>) -> Result<OwnedFd> {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!(".ssdtier-{}-{n}", std::process::id()));
    let cpath = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::Invalid(format!("path {} contains a NUL byte", path.display())))?;
    let open = |direct: bool| {
        let mut flags = libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC;
        if direct {
            flags |= libc::O_DIRECT;
        }
        // Safety: valid path; result checked.
        unsafe { libc::open(cpath.as_ptr(), flags, 0o600 as libc::c_uint) }
    };
    let mut fd = open(*direct);
    if fd < 0 && *direct && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        *direct = false;
        notices.push(format!("O_DIRECT is not supported in {}; using buffered I/O there", dir.display()));
        fd = open(false);
    }
    if fd < 0 {
        return Err(Error::last_os("open", &path, 0, 0));
    }
    // Safety: path is valid; the open fd keeps the inode alive.
    unsafe { libc::unlink(cpath.as_ptr()) };
    *tmpfile = false;
    notices.push(format!(
        "O_TMPFILE is not supported in {}; using a file unlinked right after creation instead",
        dir.display()
    ));
    // Safety: fd is fresh and owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn clear_direct(fd: RawFd) {
    // Safety: fcntl on an owned fd.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_DIRECT);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub fn real_dir() -> tempfile::TempDir {
        // O_DIRECT is never tested on tmpfs: use the crate's target directory (a real file system).
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-stores");
        std::fs::create_dir_all(&base).unwrap();
        tempfile::tempdir_in(base).unwrap()
    }

    #[test]
    fn opens_nameless_private_direct_file() {
        let d = real_dir();
        let sub = d.path().join("a/b");
        let mut notes = Vec::new();
        let f = DeviceFile::open(&sub, true, &mut notes).unwrap();
        assert!(f.direct, "{notes:?}");
        assert!(f.tmpfile);
        assert!(notes.is_empty(), "{notes:?}");
        // Nameless: the directory stays empty.
        assert_eq!(std::fs::read_dir(&sub).unwrap().count(), 0);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&sub).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(f.size(), 0);
    }

    #[test]
    fn refuses_a_file_as_directory() {
        let d = real_dir();
        let p = d.path().join("plain");
        std::fs::write(&p, b"x").unwrap();
        let err = DeviceFile::open(&p, true, &mut Vec::new()).err().unwrap();
        assert_eq!(err.errno(), Some(libc::ENOTDIR));
    }

    #[test]
    fn tmpfs_falls_back_with_a_notice() {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            return;
        }
        let d = tempfile::tempdir_in(shm).unwrap();
        let mut notes = Vec::new();
        let f = DeviceFile::open(d.path(), true, &mut notes).unwrap();
        if f.direct {
            // Kernels since 6.6 take O_DIRECT on tmpfs: then it really works, and nothing is said.
            assert!(notes.is_empty(), "{notes:?}");
            assert!(f.probe_direct_write());
        } else {
            assert_eq!(notes.len(), 1, "{notes:?}");
            assert!(notes[0].contains("O_DIRECT"), "{notes:?}");
            // Safety: fcntl on an fd the file owns.
            let flags = unsafe { libc::fcntl(f.raw_fd(), libc::F_GETFL) };
            assert_eq!(flags & libc::O_DIRECT, 0, "buffered means the flag is off");
        }
    }
}
