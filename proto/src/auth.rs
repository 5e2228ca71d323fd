//! The cluster secret: every connection between kvfs processes proves it before its first
//! message when the cluster has one.
//!
//! Mechanism. A secret is a file given to every master, node, client and mount; its contents
//! (surrounding whitespace trimmed, at least [`SECRET_BYTES_MIN`] bytes) derive a 32-byte key
//! with blake3's `derive_key`. A connection starts with a mutual challenge-response, the
//! connecting side first, before any message of the connection's own protocol:
//!
//! ```text
//! C -> A   MAGIC nonce_c                       (8 + 32 bytes)
//! A -> C   MAGIC OK nonce_a mac_a              (8 + 1 + 32 + 32)  mac_a = keyed(K, "acceptor" nonce_c nonce_a)
//!     or   MAGIC REFUSED len reason            (the acceptor has no secret)
//! C -> A   mac_c                               (32)               mac_c = keyed(K, "connector" nonce_a nonce_c)
//! A -> C   OK                                  (1), or MAGIC REFUSED len reason, then close
//! ```
//!
//! Each side proves it holds the key over a nonce the other side drew, under a label of its
//! own role, so neither an eavesdropper's replay nor a stranger using one side as an oracle
//! yields a valid proof. Comparisons are constant time (`blake3::Hash`).
//!
//! Mixed configurations fail at once with a clear error instead of a timeout: an acceptor
//! with a secret answers a connector's first protocol bytes (not `MAGIC`) with `MAGIC REFUSED
//! ...` and closes, and frame readers report a frame starting with `MAGIC` as
//! [`FrameError::SecretRequired`](crate::FrameError::SecretRequired); an acceptor without a
//! secret reads `MAGIC` where a frame length belongs, fails that read and closes, which the
//! connector reports as a refusal.
//!
//! Not handled: encryption (bytes still cross the network in the clear; the secret keeps
//! strangers from reading, writing or registering, not eavesdroppers from seeing).

use std::future::Future;
use std::io::{Read, Write};
use std::path::Path;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// First bytes of every handshake message from either side (its first 4 bytes are what frame
/// readers look for).
pub const MAGIC: [u8; 8] = *b"KVFSAUTH";
/// The environment variable naming the secret file, for processes configured without flags
/// (the Python package, engines that embed the client).
pub const SECRET_FILE_ENV: &str = "KVFS_CLUSTER_SECRET_FILE";
/// Shortest secret accepted, in bytes after trimming.
pub const SECRET_BYTES_MIN: usize = 16;
/// Longest secret file read.
pub const SECRET_FILE_BYTES_MAX: u64 = 64 << 10;

const OK: u8 = 0;
const REFUSED: u8 = 1;
const NONCE: usize = 32;
const DERIVE_CONTEXT: &str = "kvfs cluster secret 2026-12 v1";

/// The key every member of a cluster derives from its secret file.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ClusterSecret {
    key: [u8; 32],
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The peer does not hold this cluster's secret (or holds none).
    #[error("{0}")]
    Refused(String),
    /// The stream failed or closed in the middle of the handshake.
    #[error("cluster secret handshake: {0}")]
    Io(String),
}

impl ClusterSecret {
    /// Derives the key from a secret's bytes (surrounding whitespace ignored).
    pub fn from_bytes(secret: &[u8]) -> Result<ClusterSecret, String> {
        let trimmed = secret.trim_ascii();
        if trimmed.len() < SECRET_BYTES_MIN {
            return Err(format!(
                "a cluster secret needs at least {SECRET_BYTES_MIN} bytes, this one has {}",
                trimmed.len()
            ));
        }
        Ok(ClusterSecret { key: blake3::derive_key(DERIVE_CONTEXT, trimmed) })
    }

    /// Reads a secret file (at most [`SECRET_FILE_BYTES_MAX`] bytes).
    pub fn from_file(path: &Path) -> Result<ClusterSecret, String> {
        let what = |e: String| format!("cluster secret file {}: {e}", path.display());
        let file = std::fs::File::open(path).map_err(|e| what(e.to_string()))?;
        let mut bytes = Vec::new();
        file.take(SECRET_FILE_BYTES_MAX + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| what(e.to_string()))?;
        if bytes.len() as u64 > SECRET_FILE_BYTES_MAX {
            return Err(what(format!("longer than {SECRET_FILE_BYTES_MAX} bytes")));
        }
        ClusterSecret::from_bytes(&bytes).map_err(what)
    }

    /// The secret named by `KVFS_CLUSTER_SECRET_FILE`, when that is set (and not empty).
    pub fn from_env() -> Result<Option<ClusterSecret>, String> {
        match std::env::var_os(SECRET_FILE_ENV) {
            Some(p) if !p.is_empty() => ClusterSecret::from_file(Path::new(&p)).map(Some),
            _ => Ok(None),
        }
    }

    fn mac(&self, label: &[u8], first: &[u8; NONCE], second: &[u8; NONCE]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(label).update(first).update(second);
        h.finalize()
    }
}

fn nonce() -> [u8; NONCE] {
    rand::random()
}

fn refusal(reason: &str) -> Vec<u8> {
    let reason = &reason.as_bytes()[..reason.len().min(255)];
    let mut m = Vec::with_capacity(MAGIC.len() + 2 + reason.len());
    m.extend_from_slice(&MAGIC);
    m.push(REFUSED);
    m.push(reason.len() as u8);
    m.extend_from_slice(reason);
    m
}

const WITHOUT_SECRET: &str = "refused by the peer: this process holds no cluster secret and the peer requires one \
     (--cluster-secret-file, or KVFS_CLUSTER_SECRET_FILE)";
const NO_SECRET_THERE: &str = "the peer closed the connection at the cluster secret handshake: \
     it runs without a cluster secret, or with another one";
const WRONG_SECRET: &str = "wrong cluster secret";

fn io(e: std::io::Error) -> AuthError {
    AuthError::Io(e.to_string())
}

fn eof_as(e: std::io::Error, what: &str) -> AuthError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => AuthError::Refused(what.to_string()),
        _ => io(e),
    }
}

/// Parses an acceptor's refusal after `MAGIC REFUSED` was read: the reason bytes follow.
fn refused_with(reason: &[u8]) -> AuthError {
    AuthError::Refused(format!("refused by the peer: {}", String::from_utf8_lossy(reason)))
}

/// The connecting side of the handshake, on an async stream.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &ClusterSecret,
) -> Result<(), AuthError> {
    let nc = nonce();
    let mut hello = Vec::with_capacity(MAGIC.len() + NONCE);
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&nc);
    s.write_all(&hello).await.map_err(io)?;
    let mut head = [0u8; 9];
    s.read_exact(&mut head).await.map_err(|e| eof_as(e, NO_SECRET_THERE))?;
    if head[..8] != MAGIC {
        return Err(AuthError::Refused(NO_SECRET_THERE.to_string()));
    }
    if head[8] != OK {
        let mut len = [0u8; 1];
        s.read_exact(&mut len).await.map_err(io)?;
        let mut reason = vec![0u8; len[0] as usize];
        s.read_exact(&mut reason).await.map_err(io)?;
        return Err(refused_with(&reason));
    }
    let mut body = [0u8; NONCE + 32];
    s.read_exact(&mut body).await.map_err(|e| eof_as(e, NO_SECRET_THERE))?;
    let na: [u8; NONCE] = body[..NONCE].try_into().expect("nonce length");
    let mac_a: [u8; 32] = body[NONCE..].try_into().expect("mac length");
    if secret.mac(b"acceptor", &nc, &na) != blake3::Hash::from_bytes(mac_a) {
        return Err(AuthError::Refused(format!(
            "the peer holds another cluster secret: {WRONG_SECRET}"
        )));
    }
    s.write_all(secret.mac(b"connector", &na, &nc).as_bytes()).await.map_err(io)?;
    let mut ok = [0u8; 1];
    s.read_exact(&mut ok).await.map_err(|e| eof_as(e, WRONG_SECRET))?;
    if ok[0] != OK {
        return Err(AuthError::Refused(format!("refused by the peer: {WRONG_SECRET}")));
    }
    Ok(())
}

/// The accepting side of the handshake, on an async stream. A connector that does not start
/// with the handshake, or proves another secret, is told why before the error returns (the
/// caller closes the stream).
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &ClusterSecret,
) -> Result<(), AuthError> {
    let mut hello = [0u8; MAGIC.len() + NONCE];
    let mut got = 0;
    // The magic alone tells a connector without a secret apart; do not wait for 40 bytes of
    // a protocol message that may be shorter.
    while got < MAGIC.len() {
        let n = s.read(&mut hello[got..MAGIC.len()]).await.map_err(io)?;
        if n == 0 {
            return Err(AuthError::Io("closed before the handshake".into()));
        }
        got += n;
        if hello[..got] != MAGIC[..got] {
            let _ = s.write_all(&refusal("this peer requires the cluster secret")).await;
            return Err(AuthError::Refused("a connection without the cluster secret".into()));
        }
    }
    s.read_exact(&mut hello[MAGIC.len()..]).await.map_err(io)?;
    let nc: [u8; NONCE] = hello[MAGIC.len()..].try_into().expect("nonce length");
    let na = nonce();
    let mut answer = Vec::with_capacity(MAGIC.len() + 1 + NONCE + 32);
    answer.extend_from_slice(&MAGIC);
    answer.push(OK);
    answer.extend_from_slice(&na);
    answer.extend_from_slice(secret.mac(b"acceptor", &nc, &na).as_bytes());
    s.write_all(&answer).await.map_err(io)?;
    let mut mac_c = [0u8; 32];
    s.read_exact(&mut mac_c).await.map_err(io)?;
    if secret.mac(b"connector", &na, &nc) != blake3::Hash::from_bytes(mac_c) {
        let _ = s.write_all(&refusal(WRONG_SECRET)).await;
        return Err(AuthError::Refused("a connection with a wrong cluster secret".into()));
    }
    s.write_all(&[OK]).await.map_err(io)?;
    Ok(())
}

/// [`connect`] on a blocking stream (the shm transport's Unix sockets; the caller sets its
/// timeouts): the same exchange, each read and write blocking the calling thread.
pub fn connect_blocking<S: Read + Write>(
    s: &mut S,
    secret: &ClusterSecret,
) -> Result<(), AuthError> {
    let mut s = Blocking(s);
    let fut = std::pin::pin!(connect(&mut s, secret));
    match fut.poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
        std::task::Poll::Ready(r) => r,
        // Every read and write of `Blocking` is ready when it returns.
        std::task::Poll::Pending => unreachable!("a blocking stream never returns Pending"),
    }
}

/// A blocking stream seen as an async one whose every operation completes when polled.
struct Blocking<'a, S>(&'a mut S);

impl<S: Read> AsyncRead for Blocking<'_, S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let n = self.0.read(buf.initialize_unfilled());
        std::task::Poll::Ready(n.map(|n| buf.advance(n)))
    }
}

impl<S: Write> AsyncWrite for Blocking<'_, S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::task::Poll::Ready(self.0.write(buf))
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(self.0.flush())
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// Whether a frame's first four bytes are the start of a handshake message: a peer that
/// requires the cluster secret refusing a connection that did not prove it.
pub fn is_handshake_prefix(first: &[u8; 4]) -> bool {
    first[..] == MAGIC[..4]
}

/// The error a frame reader reports for [`is_handshake_prefix`].
pub fn secret_required() -> String {
    WITHOUT_SECRET.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> ClusterSecret {
        ClusterSecret::from_bytes(s.as_bytes()).unwrap()
    }

    async fn pair(
        c: Option<ClusterSecret>,
        a: Option<ClusterSecret>,
    ) -> (Result<(), AuthError>, Result<(), AuthError>) {
        let (mut x, mut y) = tokio::io::duplex(4096);
        let conn = async move {
            let r = match c {
                Some(c) => connect(&mut x, &c).await,
                None => {
                    // A connector without a secret sends its protocol's first frame and reads
                    // the answer as a frame.
                    crate::write_msg(&mut x, &7u32).await.unwrap();
                    match crate::read_frame(&mut x, 1024).await {
                        Err(crate::FrameError::SecretRequired(m)) => Err(AuthError::Refused(m)),
                        other => panic!("{other:?}"),
                    }
                }
            };
            drop(x);
            r
        };
        let acc = async move {
            let r = match a {
                Some(a) => accept(&mut y, &a).await,
                None => {
                    // An acceptor without a secret reads a frame, fails and closes.
                    let r = crate::read_frame(&mut y, 1024).await;
                    assert!(matches!(r, Err(crate::FrameError::SecretRequired(_))), "{r:?}");
                    Err(AuthError::Io("closed".into()))
                }
            };
            drop(y);
            r
        };
        tokio::join!(conn, acc)
    }

    #[tokio::test]
    async fn same_secret_passes_and_anything_else_is_refused() {
        let k = secret("0123456789abcdef-the-secret");
        let other = secret("0123456789abcdef-not-the-secret");
        assert_eq!(pair(Some(k), Some(k)).await, (Ok(()), Ok(())));

        let (c, a) = pair(Some(other), Some(k)).await;
        assert!(
            matches!(c, Err(AuthError::Refused(ref m)) if m.contains("another cluster secret")),
            "{c:?}"
        );
        assert!(a.is_err(), "the acceptor must not pass a wrong secret: {a:?}");

        let (c, a) = pair(None, Some(k)).await;
        assert!(
            matches!(c, Err(AuthError::Refused(ref m)) if m.contains("holds no cluster secret")),
            "{c:?}"
        );
        assert!(matches!(a, Err(AuthError::Refused(_))), "{a:?}");

        let (c, _) = pair(Some(k), None).await;
        assert!(
            matches!(c, Err(AuthError::Refused(ref m)) if m.contains("without a cluster secret")),
            "{c:?}"
        );
    }

    #[test]
    fn secrets_are_checked_and_whitespace_does_not_count() {
        assert!(ClusterSecret::from_bytes(b"  short \n").unwrap_err().contains("at least 16"));
        assert_eq!(secret("0123456789abcdef\n"), secret("  0123456789abcdef"));
        assert_ne!(secret("0123456789abcdef"), secret("0123456789abcdeg"));
        assert_eq!(format!("{:?}", secret("0123456789abcdef")), "ClusterSecret(..)");
        let dir = std::env::temp_dir().join(format!("kvfs-secret-{}", std::process::id()));
        assert!(ClusterSecret::from_file(&dir).unwrap_err().contains(&dir.display().to_string()));
    }
}
