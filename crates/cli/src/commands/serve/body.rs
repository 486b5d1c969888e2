//! Request bodies read within the server's limits: size, declared and sent, and time.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, StatusCode};
use futures_util::StreamExt;

use super::api::ApiError;

/// Largest request body.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Time a client has to send its body.
const BODY_TIMEOUT: Duration = Duration::from_secs(30);

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        None,
        format!("the request body is larger than {MAX_BODY_BYTES} bytes"),
    )
}

/// Refuses a body whose declared length is over the limit before any of it is read, so the
/// client is not told `100 Continue` and nothing is waited for. (hyper has already refused
/// a `Content-Length` that is not a number, or two that disagree.)
pub fn check_declared(headers: &HeaderMap) -> Result<(), ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match declared {
        Some(n) if n > MAX_BODY_BYTES as u64 => Err(too_large()),
        _ => Ok(()),
    }
}

/// The whole body: 413 past [`MAX_BODY_BYTES`] (chunked bodies declare no length), 400 when
/// its framing is broken (a bad chunk, or the connection closed before the declared length
/// arrived), 408 when it takes longer than [`BODY_TIMEOUT`].
pub async fn read(body: Body) -> Result<Vec<u8>, ApiError> {
    let read = async {
        let mut data = body.into_data_stream();
        let mut bytes = Vec::new();
        while let Some(chunk) = data.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::invalid(
                    None,
                    format!("the request body is malformed or was cut off: {e}"),
                )
            })?;
            if bytes.len() + chunk.len() > MAX_BODY_BYTES {
                return Err(too_large());
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    };
    match tokio::time::timeout(BODY_TIMEOUT, read).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            None,
            format!(
                "the request body did not arrive within {} s",
                BODY_TIMEOUT.as_secs()
            ),
        )),
    }
}
