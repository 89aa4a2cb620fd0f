//! A live publication's data file in shared memory, readable by consumers on the same host
//! without HTTP.
//!
//! A publisher lays its data file out in memory and serves it over HTTP ([`crate::RangeServer`]).
//! A consumer on another host needs that; one on the same host does not: over loopback the socket,
//! hyper's buffers and the response's collection cost several copies of every byte (0.9–1.6 s for
//! 0.88 GB in the issue-43 benchmark, against 0.2–0.35 s reading the same bytes from the page
//! cache). So the publisher keeps the file in a `memfd` ([`SharedFile`]): anonymous shared memory
//! that the kernel frees with its last reference, so a publisher that dies leaks nothing. Its
//! part names the file ([`SharedHandle`]: the host's boot id, the publisher's pid and fd, the
//! file's inode, size and name). A consumer on the same host opens it through
//! `/proc/<pid>/fd/<fd>` ([`open_shared`]) and, having checked that the file it got is that one
//! (same boot, the same inode, size and name on its own descriptor), reads it by position like a
//! local file, straight into its destinations. Its descriptor keeps the memory alive until the
//! load ends, even if the publisher retires the step or dies meanwhile: the step's bytes, which
//! the load verifies against the checksums recorded at snapshot time either way.
//!
//! Where any of it is refused (another host, a container with its own pid namespace, ptrace
//! rules, a kernel without `memfd_create`), the consumer reads over HTTP as before.

#![allow(unsafe_code)]

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// What a consumer needs to open a publisher's shared file on the same host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedHandle {
    /// The host's boot id (`/proc/sys/kernel/random/boot_id`): another host, or this one
    /// rebooted, never matches.
    pub boot_id: String,
    /// The publishing process.
    pub pid: u32,
    /// Its descriptor of the file.
    pub fd: i32,
    /// The file's inode (unique among the live shared-memory files of the host).
    pub inode: u64,
    /// The file's size.
    pub size: u64,
    /// The file's name, a random part included (`/proc/.../fd/N` reads `/memfd:<name> (deleted)`).
    pub name: String,
}

/// This host's boot id, trimmed; `None` where there is no `/proc`.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// A data file held in a `memfd`, mapped read-only for serving.
pub struct SharedFile {
    file: File,
    map: *const u8,
    len: usize,
    handle: SharedHandle,
}

// SAFETY: the mapping is read-only (PROT_READ) and lives as long as the value; sharing a
// pointer to immutable memory between threads is sound.
unsafe impl Send for SharedFile {}
// SAFETY: as above; nothing mutates through `map`.
unsafe impl Sync for SharedFile {}

impl std::fmt::Debug for SharedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedFile")
            .field("handle", &self.handle)
            .finish_non_exhaustive()
    }
}

impl SharedFile {
    /// A shared file named after `tag` (plus a random part) holding `bytes`.
    pub fn create(tag: &str, bytes: &[u8]) -> std::io::Result<Arc<SharedFile>> {
        let mut writer = SharedFileWriter::new(tag)?;
        writer.append(bytes)?;
        writer.finish()
    }

    /// What a consumer on this host opens it by.
    pub fn handle(&self) -> &SharedHandle {
        &self.handle
    }

    /// The file's bytes, served without a copy; the file stays open while any clone lives.
    pub fn bytes(self: &Arc<Self>) -> Bytes {
        Bytes::from_owner(Mapped(Arc::clone(self)))
    }

    /// This file as a writer again, to lay a new data file out from its start in the memory it
    /// holds (a retired step's: its pages are already there, so the new step's writes fault in
    /// nothing and the kernel need not reclaim page cache to give it fresh ones). Refused while
    /// anything else holds the file (a `Bytes` the range server hands a response), since that
    /// reader's bytes would change under it: the file comes back in the error then.
    ///
    /// The file keeps its inode and name; [`SharedFileWriter::finish`] cuts it to its new length
    /// and the new handle names that size. A consumer still holding a descriptor of the old step
    /// reads the new step's bytes, which the old step's checksums then refuse: never wrong values.
    pub fn into_writer(this: Arc<Self>) -> Result<SharedFileWriter, Arc<Self>> {
        let file = Arc::try_unwrap(this)?;
        // A second descriptor of the same open file: the old one closes with its mapping when
        // `file` drops here.
        let Ok(descriptor) = file.file.try_clone() else {
            return Err(Arc::new(file));
        };
        Ok(SharedFileWriter {
            file: descriptor,
            len: 0,
            name: file.handle.name.clone(),
            boot_id: file.handle.boot_id.clone(),
        })
    }

    /// The file's size.
    pub fn size(&self) -> u64 {
        self.handle.size
    }

    /// Overwrites byte `offset` with its bits flipped, in place (what a memory error would do;
    /// for tests of the consumers' verification, which must catch it whichever way they read).
    pub fn flip_byte(&self, offset: u64) -> std::io::Result<()> {
        let mut byte = [0u8];
        self.file.read_exact_at(&mut byte, offset)?;
        byte[0] ^= 0xff;
        self.file.write_all_at(&byte, offset)
    }
}

impl Drop for SharedFile {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: `map` is the mapping of `len` bytes made in `create`, not used after this.
            unsafe {
                libc::munmap(self.map as *mut libc::c_void, self.len);
            }
        }
    }
}

/// A shared file being written: bytes appended in order (a data file laid out straight into
/// shared memory, no buffer in between), then mapped for serving ([`SharedFileWriter::finish`]).
#[derive(Debug)]
pub struct SharedFileWriter {
    file: File,
    len: u64,
    name: String,
    boot_id: String,
}

impl SharedFileWriter {
    /// An empty shared file named after `tag` (plus a random part).
    #[cfg(target_os = "linux")]
    pub fn new(tag: &str) -> std::io::Result<SharedFileWriter> {
        use std::hash::BuildHasher;
        use std::os::fd::FromRawFd;
        let boot_id = boot_id().ok_or_else(|| std::io::Error::other("no boot id in /proc"))?;
        let nonce = std::hash::RandomState::new().hash_one((std::process::id(), tag));
        // The kernel caps a memfd's name at 249 bytes; the tag is cut on a char boundary.
        let tag: String = tag.chars().take(200).collect();
        let name = format!("{tag}-{nonce:016x}");
        let c_name = std::ffi::CString::new(name.clone())
            .map_err(|_| std::io::Error::other("a shared file's name holds a NUL byte"))?;
        // SAFETY: `c_name` is a valid NUL-terminated string; the returned descriptor is owned
        // by the File made from it (or the error is returned before).
        let fd = unsafe { libc::memfd_create(c_name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        Ok(SharedFileWriter {
            file,
            len: 0,
            name,
            boot_id,
        })
    }

    /// Shared files need Linux (`memfd_create`, `/proc`).
    #[cfg(not(target_os = "linux"))]
    pub fn new(_tag: &str) -> std::io::Result<SharedFileWriter> {
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "shared files need Linux",
        ))
    }

    /// Appends `data` at the end (one `pwrite`: the kernel copies it into the file's pages).
    pub fn append(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.file.write_all_at(data, self.len)?;
        self.len += data.len() as u64;
        Ok(())
    }

    /// The file, mapped read-only for serving. A file rewritten from a retired step's
    /// ([`SharedFile::into_writer`]) is cut to what was written.
    pub fn finish(self) -> std::io::Result<Arc<SharedFile>> {
        use std::os::fd::AsRawFd;
        if self.file.metadata()?.len() != self.len {
            self.file.set_len(self.len)?;
        }
        let len = usize::try_from(self.len)
            .map_err(|_| std::io::Error::other("a shared file larger than the address space"))?;
        let map = if len == 0 {
            std::ptr::NonNull::<u8>::dangling().as_ptr() as *const u8
        } else {
            // SAFETY: maps `len` bytes of a file of that size read-only and shared; the mapping
            // is unmapped in SharedFile's Drop, after which nothing refers to it.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    self.file.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(std::io::Error::last_os_error());
            }
            p as *const u8
        };
        let handle = SharedHandle {
            boot_id: self.boot_id,
            pid: std::process::id(),
            fd: self.file.as_raw_fd(),
            inode: self.file.metadata()?.ino(),
            size: self.len,
            name: self.name,
        };
        Ok(Arc::new(SharedFile {
            file: self.file,
            map,
            len,
            handle,
        }))
    }
}

/// The mapping as a `Bytes` owner.
struct Mapped(Arc<SharedFile>);

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `map` points to `len` readable bytes for as long as the SharedFile lives,
        // which this value keeps alive; the memory is never written through the mapping (a
        // write through the descriptor, `flip_byte`, is a test's deliberate damage).
        unsafe { std::slice::from_raw_parts(self.0.map, self.0.len) }
    }
}

/// Opens the shared file `handle` names from this process: on the same boot of the same host,
/// through `/proc/<pid>/fd/<fd>`, and only if the descriptor it gets is that file (the inode,
/// size and name match). The error says why it cannot (another host, a process gone, ptrace
/// rules, another file under that descriptor); the caller then reads over HTTP.
pub fn open_shared(handle: &SharedHandle) -> Result<File, String> {
    if boot_id().as_deref() != Some(handle.boot_id.as_str()) {
        return Err("published on another host (or another boot of this one)".to_string());
    }
    let path = format!("/proc/{}/fd/{}", handle.pid, handle.fd);
    let file = File::open(&path).map_err(|e| format!("cannot open {path}: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot stat {path}: {e}"))?;
    if meta.ino() != handle.inode || meta.len() != handle.size {
        return Err(format!(
            "{path} is inode {} of {} bytes, not the published inode {} of {} bytes",
            meta.ino(),
            meta.len(),
            handle.inode,
            handle.size
        ));
    }
    // The name on our own descriptor: race-free, whatever became of the publisher since.
    let own = own_fd_path(&file);
    let link = std::fs::read_link(&own).map_err(|e| format!("cannot read {own}: {e}"))?;
    let expected = format!("/memfd:{}", handle.name);
    let link = link.to_string_lossy();
    if link.strip_suffix(" (deleted)").unwrap_or(&link) != expected {
        return Err(format!("{path} is {link}, not {expected}"));
    }
    Ok(file)
}

/// `/proc/self/fd/<n>` of `file`: a path that opens this very file again (positioned reads open
/// their files by path).
pub fn own_fd_path(file: &File) -> String {
    use std::os::fd::AsRawFd;
    format!("/proc/self/fd/{}", file.as_raw_fd())
}

#[cfg(all(test, target_os = "linux"))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_file_opens_by_its_handle_and_reads_its_bytes() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let shared = SharedFile::create("tessera-test-share", &bytes).unwrap();
        assert_eq!(shared.bytes().as_ref(), &bytes[..]);
        let file = open_shared(shared.handle()).unwrap();
        let mut back = vec![0u8; bytes.len()];
        file.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(back, bytes);
        // Reopened by the consumer's own path, as positioned reads do.
        let again = File::open(own_fd_path(&file)).unwrap();
        let mut piece = [0u8; 16];
        again.read_exact_at(&mut piece, 500).unwrap();
        assert_eq!(&piece[..], &bytes[500..516]);
    }

    #[test]
    fn the_consumers_descriptor_outlives_the_publishers_file() {
        let bytes = vec![7u8; 4096];
        let shared = SharedFile::create("tessera-test-outlive", &bytes).unwrap();
        let file = open_shared(shared.handle()).unwrap();
        let handle = shared.handle().clone();
        drop(shared);
        let mut back = vec![0u8; 4096];
        file.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(back, bytes);
        // Opening it anew after the publisher let go fails (its descriptor is closed).
        let err = open_shared(&handle).unwrap_err();
        assert!(
            err.contains(&format!("/proc/{}/fd/{}", handle.pid, handle.fd)),
            "{err}"
        );
    }

    #[test]
    fn a_handle_of_another_file_or_host_is_refused() {
        let shared = SharedFile::create("tessera-test-refuse", &[1, 2, 3]).unwrap();
        let other = SharedFile::create("tessera-test-other", &[1, 2, 3]).unwrap();
        let mut wrong = shared.handle().clone();
        wrong.fd = other.handle().fd;
        let err = open_shared(&wrong).unwrap_err();
        assert!(err.contains("not the published inode"), "{err}");
        let mut renamed = shared.handle().clone();
        renamed.name.push('x');
        let err = open_shared(&renamed).unwrap_err();
        assert!(err.contains("not /memfd:"), "{err}");
        let mut elsewhere = shared.handle().clone();
        elsewhere.boot_id = "another-host".to_string();
        let err = open_shared(&elsewhere).unwrap_err();
        assert!(err.contains("another host"), "{err}");
    }

    #[test]
    fn a_flipped_byte_shows_through_the_mapping_and_the_descriptor() {
        let shared = SharedFile::create("tessera-test-flip", &[0u8; 64]).unwrap();
        let served = shared.bytes();
        shared.flip_byte(10).unwrap();
        assert_eq!(served[10], 0xff);
        let file = open_shared(shared.handle()).unwrap();
        let mut b = [0u8];
        file.read_exact_at(&mut b, 10).unwrap();
        assert_eq!(b[0], 0xff);
    }

    #[test]
    fn a_retired_file_is_rewritten_in_its_own_memory_and_only_when_nothing_holds_it() {
        let old: Vec<u8> = (0..3 * 4096u32).map(|i| (i % 253) as u8).collect();
        let shared = SharedFile::create("tessera-test-reuse", &old).unwrap();
        let (inode, name) = (shared.handle().inode, shared.handle().name.clone());
        // A range server's response still holds the bytes: refused, the file given back whole.
        let served = shared.bytes();
        let shared = SharedFile::into_writer(shared).unwrap_err();
        assert_eq!(shared.bytes().as_ref(), &old[..]);
        drop(served);
        let old_handle = shared.handle().clone();
        let mut writer = SharedFile::into_writer(shared).unwrap();
        // A shorter step: rewritten from the start, cut to what was written.
        let new: Vec<u8> = (0..5000u32).map(|i| (i % 7) as u8).collect();
        writer.append(&new[..1000]).unwrap();
        writer.append(&new[1000..]).unwrap();
        let reused = writer.finish().unwrap();
        assert_eq!(reused.bytes().as_ref(), &new[..]);
        assert_eq!(
            (reused.handle().inode, &reused.handle().name, reused.size()),
            (inode, &name, 5000)
        );
        let file = open_shared(reused.handle()).unwrap();
        let mut back = vec![0u8; new.len()];
        file.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(back, new);
        // The old step's handle (its size) no longer opens: that file is gone.
        let mut stale = old_handle;
        stale.fd = reused.handle().fd;
        let err = open_shared(&stale).unwrap_err();
        assert!(err.contains("not the published inode"), "{err}");
        // A longer one grows it.
        let mut writer = SharedFile::into_writer(reused).unwrap();
        writer.append(&old).unwrap();
        writer.append(&new).unwrap();
        let grown = writer.finish().unwrap();
        assert_eq!(grown.size(), (old.len() + new.len()) as u64);
        assert_eq!(&grown.bytes()[old.len()..], &new[..]);
    }
}
