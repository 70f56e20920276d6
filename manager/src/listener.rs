//! The manager's socket: where it may be created, what may be replaced.
//!
//! A process of another uid must not be able to stand in for the manager
//! (bind the path first, or swap the file later), so the socket goes only
//! into a directory no one else can write to, or a sticky one (like
//! `/tmp`) where no one else can remove or rename what we own. Anything
//! already at the path is replaced only when it is ours and not a live
//! manager's: a stale socket from a crash, or a symlink (dangling or not;
//! never followed).
//!
//! Under systemd socket activation ([`from_systemd`]) the socket is
//! systemd's: created by the `.socket` unit, handed over as a descriptor,
//! and never removed or replaced here. It must still be a listening Unix
//! stream socket at a path, owned by this user, reachable by no one else.

use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::ServeError;

fn refuse(path: &Path, reason: impl Into<String>) -> ServeError {
    ServeError::Socket {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Checks the socket's directory and clears a stale entry at `path`.
pub fn prepare(path: &Path, uid: u32) -> Result<(), ServeError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let meta = std::fs::metadata(dir)
        .map_err(|e| refuse(path, format!("its directory {}: {e}", dir.display())))?;
    let mode = meta.mode();
    let others_write = mode & 0o022 != 0;
    let sticky = mode & 0o1000 != 0;
    if others_write && !sticky {
        return Err(refuse(
            path,
            format!(
                "its directory {} (mode {:o}) is writable by others and not sticky: \
                 another user could replace the socket",
                dir.display(),
                mode & 0o7777
            ),
        ));
    }
    if meta.uid() != uid && meta.uid() != 0 {
        return Err(refuse(
            path,
            format!(
                "its directory {} belongs to uid {}, not this user or root",
                dir.display(),
                meta.uid()
            ),
        ));
    }
    let Ok(existing) = std::fs::symlink_metadata(path) else {
        return Ok(()); // nothing there
    };
    if existing.uid() != uid {
        return Err(refuse(
            path,
            format!(
                "it exists and belongs to uid {}; refusing to replace it",
                existing.uid()
            ),
        ));
    }
    let kind = existing.file_type();
    if kind.is_socket() {
        // A live manager answers; a stale socket file from a crash does not.
        if UnixStream::connect(path).is_ok() {
            return Err(refuse(path, "it is in use by another manager"));
        }
    } else if !kind.is_symlink() {
        return Err(refuse(
            path,
            "it exists and is not a socket; refusing to remove it",
        ));
    }
    std::fs::remove_file(path).map_err(|e| refuse(path, format!("removing the stale entry: {e}")))
}

/// Makes `dir` (mode 0700) if it is missing, and checks that it is this
/// user's own directory, not a symlink, that nobody else may enter: the
/// per-uid fallback directory `/tmp/orbitkv-<uid>`, where another user may
/// have been first.
pub fn private_dir(dir: &Path, uid: u32) -> Result<(), ServeError> {
    use std::os::unix::fs::DirBuilderExt as _;
    let refuse = |reason: String| ServeError::Socket {
        path: dir.to_path_buf(),
        reason,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(refuse(format!("creating it: {e}"))),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| refuse(e.to_string()))?;
    if !meta.is_dir() {
        return Err(refuse(
            "it is not a directory (a symlink is never followed)".into(),
        ));
    }
    if meta.uid() != uid {
        return Err(refuse(format!(
            "it belongs to uid {}: another user made it first; remove it or set \
             XDG_RUNTIME_DIR or --socket",
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(refuse(format!(
            "its mode is {:o}; it must be 0700",
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

/// Binds the socket with mode 0600 (set through the umask, so there is no
/// moment at which others could connect), non-blocking. In the per-uid
/// fallback directory, that directory is made (0700) and checked first.
pub fn bind(path: &Path) -> Result<UnixListener, ServeError> {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let fallback = crate::settings::fallback_socket_dir();
    if path.parent() == Some(fallback.as_path()) {
        private_dir(&fallback, uid)?;
    }
    prepare(path, uid)?;
    // SAFETY: umask only swaps the process's mask; the manager binds before
    // it starts any thread that creates files.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let listener = bound.map_err(|e| refuse(path, format!("binding: {e}")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| refuse(path, e.to_string()))?;
    Ok(listener)
}

fn activation(reason: impl Into<String>) -> ServeError {
    ServeError::Activation(reason.into())
}

/// One integer socket option of `fd`.
fn sockopt(fd: &OwnedFd, name: libc::c_int) -> std::io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: an int-sized buffer for an int option of a descriptor we own.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r == 0 {
        Ok(v)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The listening socket systemd passed to this process (socket activation,
/// sd_listen_fds(3): `LISTEN_PID` names this process, `LISTEN_FDS` counts
/// the descriptors from 3 on), and the path it is bound to; `None` when the
/// process was not socket-activated. Both variables are removed from the
/// environment, so call it before any thread starts.
///
/// Refused, naming what to change in the `.socket` unit: more than one
/// socket, anything but a listening Unix stream socket bound to a path, a
/// socket file another uid owns (`SocketUser=`), or one others may connect
/// to (`SocketMode=0600`, as the manager binds its own sockets).
pub fn from_systemd(uid: u32) -> Result<Option<(UnixListener, PathBuf)>, ServeError> {
    let fds: Vec<_> = sd_notify::listen_fds()
        .map_err(|e| activation(format!("reading LISTEN_FDS: {e}")))?
        .collect();
    let fd = match fds[..] {
        [] => return Ok(None),
        [fd] => fd,
        _ => {
            return Err(activation(format!(
                "systemd passed {} sockets (LISTEN_FDS); orbitkv serve takes exactly one: \
                 one ListenStream= in the .socket unit",
                fds.len()
            )));
        }
    };
    // SAFETY: sd_listen_fds hands descriptor 3 to this process, which has
    // not opened anything there itself (the loop is not running yet).
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let opt = |name, what: &str| {
        sockopt(&owned, name)
            .map_err(|e| activation(format!("the passed descriptor {fd} ({what}): {e}")))
    };
    if opt(libc::SO_DOMAIN, "SO_DOMAIN")? != libc::AF_UNIX
        || opt(libc::SO_TYPE, "SO_TYPE")? != libc::SOCK_STREAM
        || opt(libc::SO_ACCEPTCONN, "SO_ACCEPTCONN")? != 1
    {
        return Err(activation(format!(
            "the passed descriptor {fd} is not a listening Unix stream socket: \
             ListenStream= must name a path, with Accept=no"
        )));
    }
    let listener = UnixListener::from(owned);
    let path = listener
        .local_addr()
        .ok()
        .and_then(|a| a.as_pathname().map(Path::to_path_buf))
        .ok_or_else(|| {
            activation("the passed socket has no path (abstract or unnamed): ListenStream= must name a file")
        })?;
    let meta = std::fs::symlink_metadata(&path)
        .map_err(|e| refuse(&path, format!("the socket systemd passed: {e}")))?;
    if !meta.file_type().is_socket() {
        return Err(refuse(
            &path,
            "the path systemd's socket was bound to is no longer a socket",
        ));
    }
    if meta.uid() != uid {
        return Err(refuse(
            &path,
            format!(
                "systemd's socket belongs to uid {}, not the manager's ({uid}): set SocketUser= \
                 in the .socket unit to the service's User=",
                meta.uid()
            ),
        ));
    }
    // Connecting takes write permission: a socket others can write to
    // (systemd's default SocketMode=0666) lets them reach the manager.
    if meta.mode() & 0o022 != 0 {
        return Err(refuse(
            &path,
            format!(
                "systemd's socket has mode {:o}, others may connect: set SocketMode=0600 in \
                 the .socket unit",
                meta.mode() & 0o7777
            ),
        ));
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| refuse(&path, e.to_string()))?;
    Ok(Some((listener, path)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    fn uid() -> u32 {
        // SAFETY: getuid has no preconditions.
        unsafe { libc::getuid() }
    }

    #[test]
    fn a_dangling_symlink_is_replaced_and_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        std::os::unix::fs::symlink(dir.path().join("nowhere"), &sock).unwrap();
        let l = bind(&sock).unwrap();
        drop(l);
        assert!(!dir.path().join("nowhere").exists());
        let m = std::fs::symlink_metadata(&sock).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!(m.mode() & 0o777, 0o600);
    }

    #[test]
    fn the_private_directory_is_made_0700_and_must_stay_ours() {
        let dir = tempfile::tempdir().unwrap();
        let private = dir.path().join("orbitkv-test");
        private_dir(&private, uid()).unwrap();
        let m = std::fs::symlink_metadata(&private).unwrap();
        assert_eq!(m.mode() & 0o777, 0o700);
        // Again: it is ours already.
        private_dir(&private, uid()).unwrap();
        // Opened up, or someone else's, or a symlink: refused.
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(
            private_dir(&private, uid())
                .unwrap_err()
                .to_string()
                .contains("0700")
        );
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
        let e = private_dir(&private, uid() + 1).unwrap_err().to_string();
        assert!(e.contains("another user"), "{e}");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&private, &link).unwrap();
        assert!(
            private_dir(&link, uid())
                .unwrap_err()
                .to_string()
                .contains("symlink")
        );
    }

    #[test]
    fn an_open_directory_and_foreign_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = bind(&dir.path().join("s.sock")).unwrap_err().to_string();
        assert!(err.contains("writable by others"), "{err}");
        // Sticky is fine (like /tmp).
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        drop(bind(&dir.path().join("s.sock")).unwrap());
        // A regular file is never removed.
        let file = dir.path().join("data");
        std::fs::write(&file, b"keep").unwrap();
        let err = prepare(&file, uid()).unwrap_err().to_string();
        assert!(err.contains("not a socket"), "{err}");
        // Another uid's entry is not ours to replace.
        let err = prepare(&file, uid() + 1).unwrap_err().to_string();
        assert!(err.contains("belongs to uid"), "{err}");
        assert_eq!(std::fs::read(&file).unwrap(), b"keep");
    }
}
