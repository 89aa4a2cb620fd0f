//! Is CUDA there? Checks for the driver library (libcuda) and NCCL (libnccl) before anything
//! calls into them: cudarc loads both on first use and panics when they are missing. The answers
//! are computed once per process; every failure is a [`LoaderError::Cuda`] saying what is
//! missing and what to do, never a panic.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

use crate::LoaderError;
use crate::transport::plane::panic_text;

/// What the driver probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverInfo {
    /// CUDA devices visible to this process.
    pub devices: u32,
    /// The driver's CUDA version, e.g. 12080 for 12.8.
    pub version: i32,
}

/// Runs `f`, turning a panic (cudarc's reaction to a missing library or symbol) into an error.
pub(crate) fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, LoaderError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| LoaderError::Cuda {
        detail: format!(
            "{what}: the CUDA library could not be used: {}",
            panic_text(&*panic)
        ),
    })
}

/// The message for a machine without libcuda.
pub const DRIVER_MISSING: &str = "CUDA driver library (libcuda.so) not found: no libcuda.so or \
libcuda.so.1 could be loaded from the library path; GPU loading needs an NVIDIA GPU with its \
driver installed (check `nvidia-smi`), or load with --device cpu";

fn driver_library_present() -> bool {
    // SAFETY: loading libcuda runs its initialisers, which is the only reason cudarc marks this
    // unsafe; the library is the NVIDIA driver, and loading it is what using CUDA means.
    catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() }).unwrap_or(false)
}

/// Checks that the CUDA driver is loadable and initialises it; returns the device count and
/// driver version.
pub fn driver() -> Result<DriverInfo, LoaderError> {
    static PROBE: OnceLock<Result<DriverInfo, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            if !driver_library_present() {
                return Err(DRIVER_MISSING.to_string());
            }
            let fail = |e: LoaderError| match e {
                LoaderError::Cuda { detail } => detail,
                other => other.to_string(),
            };
            guarded("initialising the CUDA driver", cudarc::driver::result::init)
                .map_err(fail)?
                .map_err(|e| {
                    format!(
                        "the CUDA driver did not initialise ({e}); is a GPU visible (nvidia-smi, CUDA_VISIBLE_DEVICES)?"
                    )
                })?;
            let devices = guarded(
                "counting CUDA devices",
                cudarc::driver::result::device::get_count,
            )
            .map_err(fail)?
            .map_err(|e| format!("counting CUDA devices failed: {e}"))?;
            let mut version = 0;
            // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
            let versioned = guarded("asking the CUDA driver version", || unsafe {
                cudarc::driver::sys::cuDriverGetVersion(&mut version)
            })
            .map_err(fail)?;
            if versioned != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                version = 0;
            }
            Ok(DriverInfo {
                devices: u32::try_from(devices).unwrap_or(0),
                version,
            })
        })
        .clone()
        .map_err(|detail| LoaderError::Cuda { detail })
}

/// Whether libcuda can be loaded here (without initialising it). Tests use this to tell "no
/// CUDA on this machine" from a real failure.
pub fn driver_present() -> bool {
    driver_library_present()
}

/// The message for a machine with CUDA but without libnccl. `versioned_only` when
/// `libnccl.so.2` loads but the unversioned name cudarc looks for does not.
pub fn nccl_missing(versioned_only: bool) -> String {
    if versioned_only {
        "NCCL library found as libnccl.so.2, but cudarc loads it as libnccl.so: create the link \
(`ln -s <dir>/libnccl.so.2 <dir>/libnccl.so`) in a directory on LD_LIBRARY_PATH (pip's \
nvidia-nccl-cu12 ships only libnccl.so.2), or use --transport tcp"
            .to_string()
    } else {
        "NCCL library (libnccl.so) not found: the NCCL transport needs NCCL 2.x on the library \
path (the libnccl2 package, or pip's nvidia-nccl-cu12 with its lib directory on \
LD_LIBRARY_PATH), or use --transport tcp"
            .to_string()
    }
}

/// Checks the driver (see [`driver`]) and that NCCL is loadable; returns NCCL's version code
/// (e.g. 22703 for 2.27.3).
pub fn nccl() -> Result<i32, LoaderError> {
    driver()?;
    static PROBE: OnceLock<Result<i32, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // SAFETY: as for libcuda: loading libnccl runs its initialisers, nothing else.
            let present =
                catch_unwind(|| unsafe { cudarc::nccl::sys::is_culib_present() }).unwrap_or(false);
            if !present {
                // SAFETY: as above, for the versioned file name.
                let versioned = unsafe { libloading::Library::new("libnccl.so.2") }.is_ok();
                return Err(nccl_missing(versioned));
            }
            guarded(
                "asking the NCCL version",
                cudarc::nccl::result::get_nccl_version,
            )
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("NCCL did not report its version ({:?})", e.0))
        })
        .clone()
        .map_err(|detail| LoaderError::Cuda { detail })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without libcuda (like CI), the probe fails with the documented message
    /// instead of panicking; on a GPU machine it finds devices.
    #[test]
    fn driver_probe_never_panics() {
        match driver() {
            Ok(info) => assert!(driver_present() && info.devices > 0, "{info:?}"),
            Err(LoaderError::Cuda { detail }) => {
                if !driver_present() {
                    assert_eq!(detail, DRIVER_MISSING);
                }
            }
            Err(other) => panic!("wrong error kind: {other}"),
        }
    }
}
