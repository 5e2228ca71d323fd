//! Length-prefixed frames carrying `postcard` messages over any async byte stream.
//!
//! A frame is a little-endian `u32` body length followed by the body. The reader is given a
//! maximum body length and refuses anything larger before allocating, so a corrupt or hostile
//! peer cannot make us allocate gigabytes. A clean end of stream before the first byte of a
//! frame is reported as `Ok(None)`; an end of stream inside a frame is an error.

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("i/o error on frame stream: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("malformed message: {0}")]
    Decode(#[from] postcard::Error),
    /// The peer requires the cluster secret and this side did not prove it (see
    /// [`crate::auth`]).
    #[error("{0}")]
    SecretRequired(String),
}

/// Writes one frame holding `body`.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, body: &[u8]) -> Result<(), FrameError> {
    let len = u32::try_from(body.len())
        .map_err(|_| FrameError::TooLarge { len: body.len(), max: u32::MAX as usize })?;
    // One buffer, one write: small control frames should leave in one segment.
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf).await?;
    Ok(())
}

/// Reads one frame whose body is at most `max_len` bytes; `Ok(None)` on a clean end of stream.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_len: usize,
) -> Result<Option<Vec<u8>>, FrameError> {
    let mut len_buf = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut len_buf[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        got += n;
    }
    if crate::auth::is_handshake_prefix(&len_buf) {
        return Err(FrameError::SecretRequired(crate::auth::secret_required()));
    }
    let len = u32::from_le_bytes(len_buf) as usize;
    if len > max_len {
        return Err(FrameError::TooLarge { len, max: max_len });
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok(Some(body))
}

/// Serializes `msg` with postcard and writes it as one frame.
pub async fn write_msg<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), FrameError> {
    let body = postcard::to_stdvec(msg)?;
    write_frame(w, &body).await
}

/// Encodes `msg` as one complete frame (length prefix included), for transports that send
/// bytes themselves (e.g. together with file descriptors).
pub fn encode_frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let body = postcard::to_stdvec(msg)?;
    let len = u32::try_from(body.len())
        .map_err(|_| FrameError::TooLarge { len: body.len(), max: u32::MAX as usize })?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Decodes a frame body (without its length prefix) as `T`; trailing bytes are an error (a
/// body that decodes as a prefix of something else is not the message we expect).
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    let (msg, rest) = postcard::take_from_bytes(body)?;
    if !rest.is_empty() {
        return Err(FrameError::Decode(postcard::Error::DeserializeBadEncoding));
    }
    Ok(msg)
}

/// Reads one frame and decodes it as `T`; `Ok(None)` on a clean end of stream.
pub async fn read_msg<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
    max_len: usize,
) -> Result<Option<T>, FrameError> {
    match read_frame(r, max_len).await? {
        None => Ok(None),
        Some(body) => Ok(Some(decode_body(&body)?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn round_trip_and_limits() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        write_msg(&mut a, &("hello".to_string(), 7u64)).await.unwrap();
        write_frame(&mut a, &[0u8; 100]).await.unwrap();
        drop(a);
        let got: (String, u64) = read_msg(&mut b, 1024).await.unwrap().unwrap();
        assert_eq!(got, ("hello".to_string(), 7));
        let err = read_frame(&mut b, 50).await.unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { len: 100, max: 50 }), "{err}");
    }

    #[tokio::test]
    async fn eof_inside_a_frame_is_an_error() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&[10, 0, 0, 0, 1, 2]).await.unwrap();
        drop(a);
        assert!(read_frame(&mut b, 1024).await.is_err());
        let (a, mut b) = tokio::io::duplex(64);
        drop(a);
        assert!(read_frame(&mut b, 1024).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn garbage_body_is_a_decode_error() {
        let (mut a, mut b) = tokio::io::duplex(64);
        write_frame(&mut a, &[0xff, 0xff, 0xff]).await.unwrap();
        let r: Result<Option<(String, u64)>, _> = read_msg(&mut b, 1024).await;
        assert!(matches!(r, Err(FrameError::Decode(_))));
    }
}
