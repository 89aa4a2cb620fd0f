//! `tessera load --device cuda` through the real binary. On every machine: the device flag's
//! errors (no `cuda` feature, no driver, a bad value, NCCL without a GPU). On a GPU machine
//! (feature `cuda` and libcuda present; skipped elsewhere with the reason printed): loads into GPU
//! memory checked byte for byte against the formula, over the in-process, TCP and NCCL
//! transports. `make gpu-test` runs these with every other GPU test.
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use support::{fails, run_in};

/// A checkpoint path that does not exist: device errors come before the checkpoint is opened.
const NOWHERE: &str = "/nonexistent/run/step-000001";

#[test]
fn unknown_devices_are_refused_naming_the_value() {
    for value in ["gpu", "cuda:x", "cuda:"] {
        let run = run_in(
            None,
            ["load", NOWHERE, "--layout", "x.json", "--device", value],
        );
        assert_eq!(run.code, Some(2), "{value}: {}", run.stderr);
        assert!(
            run.stderr.contains(&format!("'{value}'"))
                && run.stderr.contains("expected cpu, cuda or cuda:N"),
            "{value}: {}",
            run.stderr
        );
    }
}

#[test]
fn nccl_needs_a_cuda_device() {
    let err = fails(["load", NOWHERE, "--layout", "x.json", "--transport", "nccl"]);
    if cfg!(feature = "cuda") {
        assert!(
            err.contains("--transport nccl moves data between GPUs: give --device cuda"),
            "{err}"
        );
    } else {
        assert!(err.contains("built without the `cuda` feature"), "{err}");
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn device_cuda_without_the_feature_says_how_to_rebuild() {
    for device in ["cuda", "cuda:1"] {
        let err = fails(["load", NOWHERE, "--layout", "x.json", "--device", device]);
        assert_eq!(
            err.trim(),
            format!(
                "error: CUDA: --device {device} needs CUDA, but tessera was built without the \
                 `cuda` feature; rebuild with `cargo build --release --features cuda`"
            )
        );
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::path::{Path, PathBuf};

    use tessera_loader::device::cuda::{CudaDevice, probe};

    use super::*;
    use crate::support::{layout_file, ok, s};

    fn synth_tiny(dir: &Path) -> (PathBuf, PathBuf) {
        let ckpt = crate::support::synth_saved_as(dir, &["fsdp", "--dp", "2"]);
        (ckpt, dir.join("saved.json"))
    }

    /// Why the GPU tests cannot run here, if they cannot.
    fn no_gpu() -> Option<String> {
        match CudaDevice::count() {
            Ok(0) => Some("no CUDA device is visible".to_string()),
            Ok(_) => None,
            Err(e) => Some(e.to_string()),
        }
    }

    macro_rules! needs_gpu {
        () => {
            if let Some(reason) = no_gpu() {
                println!("skipped: {reason}");
                return;
            }
        };
    }

    #[test]
    fn device_cuda_without_a_driver_is_a_clear_error() {
        if probe::driver_present() {
            println!("skipped: libcuda is present on this machine");
            return;
        }
        for args in [
            vec!["--device", "cuda"],
            vec!["--device", "cuda:0", "--transport", "tcp"],
            vec!["--device", "cuda", "--transport", "nccl"],
        ] {
            let mut command = vec!["load", NOWHERE, "--layout", "x.json"];
            command.extend(args);
            let err = fails(&command);
            assert_eq!(
                err.trim(),
                format!("error: CUDA: {}", probe::DRIVER_MISSING),
                "{command:?}"
            );
        }
    }

    fn check_report(text: &str) {
        assert!(text.contains("h2d "), "{text}");
        assert!(text.contains("GB/s through pinned staging"), "{text}");
        assert!(
            text.contains("check                every byte matches the synthetic formula"),
            "{text}"
        );
    }

    /// Every rank of fsdp dp2 → tp2 in this process, each on its GPU (or all on GPU 0), checked
    /// against the formula after copying back; and a dump that matches the host load's.
    #[test]
    fn load_into_gpu_memory_in_process() {
        needs_gpu!();
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, _) = synth_tiny(dir.path());
        let target = layout_file(
            dir.path(),
            "target.json",
            &[
                "megatron-gpt",
                "--tp",
                "2",
                "--pp",
                "1",
                "--dp",
                "1",
                "--num-layers",
                "4",
            ],
        );
        for device in ["cuda", "cuda:0"] {
            let text = ok([
                "load",
                s(&ckpt),
                "--layout",
                s(&target),
                "--device",
                device,
                "--check",
            ])
            .text();
            check_report(&text);
            assert!(text.contains("in-process, cuda:"), "{text}");
        }
        let (gpu, cpu) = (dir.path().join("gpu"), dir.path().join("cpu"));
        ok([
            "load",
            s(&ckpt),
            "--layout",
            s(&target),
            "--device",
            "cuda:0",
            "--dump",
            s(&gpu),
        ]);
        ok(["load", s(&ckpt), "--layout", s(&target), "--dump", s(&cpu)]);
        for rank in 0..2 {
            let name = format!("rank-{rank}.safetensors");
            assert!(
                std::fs::read(gpu.join(&name)).unwrap() == std::fs::read(cpu.join(&name)).unwrap(),
                "rank {rank}: the GPU load's dump differs from the host load's"
            );
        }
    }

    /// Ranks as processes over TCP, destinations on the GPU.
    #[test]
    fn load_into_gpu_memory_over_tcp() {
        needs_gpu!();
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, saved) = synth_tiny(dir.path());
        let text = ok([
            "load",
            s(&ckpt),
            "--layout",
            s(&saved),
            "--transport",
            "tcp",
            "--device",
            "cuda:0",
            "--check",
        ])
        .text();
        check_report(&text);
    }

    /// The NCCL transport at world size 1 (what one GPU allows): one process, one communicator.
    #[test]
    fn load_over_nccl_world_of_one() {
        needs_gpu!();
        if let Err(e) = probe::nccl() {
            println!("skipped: {e}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, _) = synth_tiny(dir.path());
        let whole = layout_file(dir.path(), "whole.json", &["fsdp", "--dp", "1"]);
        let text = ok([
            "load",
            s(&ckpt),
            "--layout",
            s(&whole),
            "--transport",
            "nccl",
            "--device",
            "cuda",
            "--check",
        ])
        .text();
        check_report(&text);
        assert!(text.contains("nccl processes"), "{text}");
    }

    /// Two ranks over NCCL, GPU to GPU, where there are two GPUs.
    #[test]
    fn load_over_nccl_two_gpus() {
        needs_gpu!();
        if CudaDevice::count().unwrap_or(0) < 2 {
            println!("skipped: fewer than 2 CUDA devices (NCCL refuses two ranks on one GPU)");
            return;
        }
        if let Err(e) = probe::nccl() {
            println!("skipped: {e}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, saved) = synth_tiny(dir.path());
        let replicated = layout_file(
            dir.path(),
            "dp2.json",
            &[
                "megatron-gpt",
                "--tp",
                "1",
                "--pp",
                "1",
                "--dp",
                "2",
                "--num-layers",
                "4",
            ],
        );
        for layout in [&saved, &replicated] {
            let text = ok([
                "load",
                s(&ckpt),
                "--layout",
                s(layout),
                "--transport",
                "nccl",
                "--device",
                "cuda",
                "--check",
            ])
            .text();
            check_report(&text);
        }
    }
}
