//! Where a rank's destination buffers live: host memory (`cpu`, the default) or a CUDA device
//! (`cuda`, `cuda:N`). Parsing is always available, so a build without the `cuda` feature can
//! still say what was asked for and why it cannot do it.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod load;
pub mod staging;

use std::fmt;
use std::str::FromStr;

use crate::LoaderError;

/// A device named on the command line or by an embedding application. It serializes as its name
/// (`cpu`, `cuda`, `cuda:N`), the same text it parses from.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceSpec {
    /// Host memory.
    #[default]
    Cpu,
    /// A CUDA device: `Some(n)` is `cuda:n`; `None` (plain `cuda`) lets the launcher pick one per
    /// rank (`LOCAL_RANK`, or the rank modulo the device count).
    Cuda(Option<u32>),
}

impl DeviceSpec {
    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        matches!(self, DeviceSpec::Cuda(_))
    }

    /// The CUDA ordinal for `rank` among `local_ranks` ranks of this machine given `devices`
    /// CUDA devices: the explicit `cuda:n`, else `local_rank % devices`. `None` for `cpu`.
    pub fn cuda_ordinal(&self, local_rank: u32, devices: u32) -> Option<u32> {
        match self {
            DeviceSpec::Cpu => None,
            DeviceSpec::Cuda(Some(n)) => Some(*n),
            DeviceSpec::Cuda(None) => Some(if devices == 0 {
                0
            } else {
                local_rank % devices
            }),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = LoaderError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| LoaderError::Device {
            device: text.to_string(),
            detail: format!("not a device ({why}); expected cpu, cuda or cuda:N"),
        };
        match text.trim() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(None)),
            other => match other.strip_prefix("cuda:") {
                Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => n
                    .parse()
                    .map(|n| DeviceSpec::Cuda(Some(n)))
                    .map_err(|_| bad("the device index is too large")),
                Some(_) => Err(bad("the part after `cuda:` must be a device index")),
                None => Err(bad("unknown device kind")),
            },
        }
    }
}

impl TryFrom<String> for DeviceSpec {
    type Error = LoaderError;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        text.parse()
    }
}

impl From<DeviceSpec> for String {
    fn from(device: DeviceSpec) -> String {
        device.to_string()
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(None) => f.write_str("cuda"),
            DeviceSpec::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

/// A buffer in a device's memory: CUDA device memory, or host memory standing in for it in the
/// CPU tests of the device pipeline. Its bytes are reached only through the device's copy
/// engine and data plane, never as a Rust slice.
pub trait DeviceMemory: Send + Sync + 'static {
    /// Bytes in the buffer.
    fn len(&self) -> usize;

    /// Whether it holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Checks that `len` bytes at `offset` fit in a `capacity`-byte buffer of `device`.
pub(crate) fn check_span(
    device: &str,
    what: &str,
    offset: u64,
    len: u64,
    capacity: usize,
) -> Result<(), LoaderError> {
    match offset.checked_add(len) {
        Some(end) if end <= capacity as u64 => Ok(()),
        _ => Err(LoaderError::Device {
            device: device.to_string(),
            detail: format!(
                "{what}: bytes {offset}..{} reach past the end of a {capacity}-byte buffer",
                offset.saturating_add(len)
            ),
        }),
    }
}

/// The error of asking a build without the `cuda` feature for GPU work.
pub fn cuda_not_built(what: &str) -> LoaderError {
    LoaderError::Cuda {
        detail: format!(
            "{what} needs CUDA, but tessera was built without the `cuda` feature; rebuild with `cargo build --release --features cuda`"
        ),
    }
}

/// Whether this build has the `cuda` feature (GPU loading, the NCCL transport).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_cpu_and_cuda() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!(
            "cuda".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Cuda(None)
        );
        assert_eq!(
            "cuda:3".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Cuda(Some(3))
        );
        for text in ["cpu", "cuda", "cuda:0", "cuda:12"] {
            assert_eq!(text.parse::<DeviceSpec>().unwrap().to_string(), text);
        }
    }

    /// A device crosses JSON (the CLI's spawned ranks' arguments) as its name and back.
    #[test]
    fn serializes_as_its_name() {
        for device in [
            DeviceSpec::Cpu,
            DeviceSpec::Cuda(None),
            DeviceSpec::Cuda(Some(2)),
        ] {
            let json = serde_json::to_string(&device).unwrap();
            assert_eq!(json, format!("\"{device}\""));
            assert_eq!(serde_json::from_str::<DeviceSpec>(&json).unwrap(), device);
        }
        let err = serde_json::from_str::<DeviceSpec>("\"gpu\"").unwrap_err();
        assert!(err.to_string().contains("gpu"), "{err}");
    }

    #[test]
    fn rejects_others_naming_the_value() {
        for text in [
            "gpu",
            "cuda:",
            "cuda:x",
            "cuda:-1",
            "CUDA",
            "cuda:99999999999",
            "",
        ] {
            let err = text.parse::<DeviceSpec>().unwrap_err();
            assert!(
                matches!(&err, LoaderError::Device { device, .. } if device == text),
                "{text}: {err}"
            );
            let message = err.to_string();
            assert!(
                message.contains("expected cpu, cuda or cuda:N"),
                "{message}"
            );
        }
    }

    #[test]
    fn ordinal_per_rank() {
        assert_eq!(DeviceSpec::Cpu.cuda_ordinal(3, 8), None);
        assert_eq!(DeviceSpec::Cuda(Some(5)).cuda_ordinal(3, 8), Some(5));
        assert_eq!(DeviceSpec::Cuda(None).cuda_ordinal(3, 8), Some(3));
        assert_eq!(DeviceSpec::Cuda(None).cuda_ordinal(9, 8), Some(1));
        assert_eq!(DeviceSpec::Cuda(None).cuda_ordinal(2, 0), Some(0));
    }

    #[test]
    fn not_built_error_says_how_to_rebuild() {
        let text = cuda_not_built("--device cuda").to_string();
        assert!(
            text.contains("built without the `cuda` feature")
                && text.contains("cargo build --release --features cuda"),
            "{text}"
        );
    }
}
