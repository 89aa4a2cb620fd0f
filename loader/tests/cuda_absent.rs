//! The GPU path on a machine without CUDA (feature `cuda`): opening a device, counting devices
//! and probing NCCL (the first thing `connect_nccl` does) fail with `LoaderError::Cuda` and the documented message, never a panic.
//! Skips itself (saying so) where libcuda is present; `tests/gpu.rs` covers those machines.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, missing_docs)]

use tessera_loader::LoaderError;
use tessera_loader::device::cuda::{CudaDevice, probe};

/// `Some(reason)` when this machine has libcuda, so the no-CUDA path cannot be observed here.
fn skip() -> Option<&'static str> {
    probe::driver_present().then_some("libcuda is present on this machine (see tests/gpu.rs)")
}

fn expect_missing_driver<T: std::fmt::Debug>(what: &str, result: Result<T, LoaderError>) {
    match result {
        Err(LoaderError::Cuda { detail }) => {
            assert_eq!(detail, probe::DRIVER_MISSING, "{what}");
        }
        other => panic!("{what}: expected LoaderError::Cuda, got {other:?}"),
    }
}

#[test]
fn opening_a_device_without_a_driver_is_a_clear_error() {
    if let Some(reason) = skip() {
        println!("skipped: {reason}");
        return;
    }
    expect_missing_driver("CudaDevice::count", CudaDevice::count());
    expect_missing_driver("CudaDevice::open(0)", CudaDevice::open(0));
    expect_missing_driver("CudaDevice::open(7)", CudaDevice::open(7));
    // Asking again gives the same answer (the probe is cached, not re-panicking).
    expect_missing_driver("probe::driver", probe::driver());
    let err = CudaDevice::open(0).unwrap_err().to_string();
    assert_eq!(
        err,
        "CUDA: CUDA driver library (libcuda.so) not found: no libcuda.so or libcuda.so.1 could be \
         loaded from the library path; GPU loading needs an NVIDIA GPU with its driver installed \
         (check `nvidia-smi`), or load with --device cpu"
    );
}

#[test]
fn nccl_without_a_driver_is_a_clear_error() {
    if let Some(reason) = skip() {
        println!("skipped: {reason}");
        return;
    }
    expect_missing_driver("probe::nccl", probe::nccl());
}

#[test]
fn missing_nccl_messages_say_what_to_do() {
    let plain = probe::nccl_missing(false);
    assert!(
        plain.contains("libnccl.so")
            && plain.contains("LD_LIBRARY_PATH")
            && plain.contains("--transport tcp"),
        "{plain}"
    );
    let versioned = probe::nccl_missing(true);
    assert!(
        versioned.contains("libnccl.so.2") && versioned.contains("ln -s"),
        "{versioned}"
    );
}
