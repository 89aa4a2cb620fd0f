//! Retiring a live step, and what a registry keeps of retired ones.
//!
//! Rank 0 retires a step by removing its manifest: no new load picks it, and a listing shows it
//! `retired` (its `publishers.json` stays). A publication that publishes every few minutes for
//! days would leave a step directory per step behind (parts, metadata, checksums, leases), so
//! the same call removes the directories of the publication's older retired steps: the newest
//! [`RETIRED_STEPS_KEPT`] stay (a listing still says what became of them, `@STEP` still says
//! "retired"), and a step whose consumer's lease still runs stays until a later retire finds it
//! expired. A directory is first renamed out of the step names (`.removing-step-<N>-…`), so no
//! listing or load ever sees half of one.

use std::path::{Path, PathBuf};

use tessera_metadata::formats::native::MANIFEST_FILE;

use super::lease::{step_leased, unix_seconds};
use super::listing::{is_retired, step_of};
use crate::OpsError;

/// Retired steps of a publication whose directories a retire keeps (the newest ones).
pub const RETIRED_STEPS_KEPT: usize = 8;

/// What retiring a step did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Retired {
    /// Older retired steps whose directories were removed, ascending.
    pub removed: Vec<u64>,
    /// Directories that could not be removed, each with why (left for a later retire).
    pub problems: Vec<String>,
}

/// Retires the step in `step_dir` (rank 0: removes its manifest; one already gone is fine), then
/// removes the directories of the publication's retired steps beyond the newest
/// [`RETIRED_STEPS_KEPT`] whose leases have all run out.
pub fn retire_step(step_dir: &Path) -> Result<Retired, OpsError> {
    match std::fs::remove_file(step_dir.join(MANIFEST_FILE)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(OpsError::invalid(format!(
                "retiring {}: removing its manifest: {e}",
                step_dir.display()
            )));
        }
    }
    let Some(publication) = step_dir.parent() else {
        return Ok(Retired::default());
    };
    Ok(prune_retired(
        publication,
        RETIRED_STEPS_KEPT,
        unix_seconds(),
    ))
}

/// Removes the directories of `publication`'s retired steps beyond the newest `keep`, except
/// those a lease still holds at `now`.
pub fn prune_retired(publication: &Path, keep: usize, now: f64) -> Retired {
    let mut out = Retired::default();
    let Ok(entries) = std::fs::read_dir(publication) else {
        return out;
    };
    let mut retired: Vec<(u64, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let step = step_of(e.file_name().to_str()?)?;
            let dir = e.path();
            is_retired(&dir).then_some((step, dir))
        })
        .collect();
    retired.sort_by_key(|r| std::cmp::Reverse(r.0));
    for (step, dir) in retired.into_iter().skip(keep) {
        if step_leased(&dir, now) {
            continue;
        }
        let aside = publication.join(format!(
            ".removing-step-{step}-{}-{}",
            std::process::id(),
            now.to_bits()
        ));
        let removed = std::fs::rename(&dir, &aside).and_then(|()| std::fs::remove_dir_all(&aside));
        match removed {
            Ok(()) => out.removed.push(step),
            Err(e) => out
                .problems
                .push(format!("removing retired step {}: {e}", dir.display())),
        }
    }
    out.removed.sort_unstable();
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use tessera_storage::PUBLISHERS_FILE;

    use super::*;

    fn step(publication: &Path, n: u64, files: &[&str]) -> PathBuf {
        let dir = publication.join(format!("step-{n:06}"));
        std::fs::create_dir_all(dir.join("parts")).unwrap();
        std::fs::write(dir.join("parts").join("rank-0.json"), b"{}").unwrap();
        for file in files {
            std::fs::write(dir.join(file), b"{}").unwrap();
        }
        dir
    }

    fn steps_left(publication: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(publication)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn retiring_keeps_the_newest_retired_steps_and_leased_ones_and_never_the_others() {
        let registry = tempfile::tempdir().unwrap();
        let publication = registry.path().join("policy");
        // Steps 1-11 retired, 12 complete (to be retired now), 13 incomplete, 14 complete.
        for n in 1..=11 {
            step(&publication, n, &[PUBLISHERS_FILE]);
        }
        let twelve = step(&publication, 12, &[PUBLISHERS_FILE, MANIFEST_FILE]);
        step(&publication, 13, &[]);
        step(&publication, 14, &[PUBLISHERS_FILE, MANIFEST_FILE]);
        // A consumer still reads step 2; step 3's lease ran out.
        let lease =
            super::super::lease::Lease::take(&publication.join("step-000002"), 60.0).unwrap();
        std::fs::create_dir_all(publication.join("step-000003/leases")).unwrap();
        std::fs::write(
            publication.join("step-000003/leases/old.json"),
            br#"{"taken": 1.0, "until": 2.0, "pid": 1}"#,
        )
        .unwrap();
        std::fs::write(publication.join("notes.txt"), b"not a step").unwrap();

        let retired = retire_step(&twelve).unwrap();
        assert!(!twelve.join(MANIFEST_FILE).exists());
        // Retired now: 1-12; the newest 8 (5-12) stay, 2 stays leased, 1, 3 and 4 go.
        assert_eq!(retired.removed, vec![1, 3, 4]);
        assert!(retired.problems.is_empty(), "{:?}", retired.problems);
        let mut want: Vec<String> = [2u64, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
            .iter()
            .map(|n| format!("step-{n:06}"))
            .collect();
        want.push("notes.txt".to_string());
        want.sort();
        assert_eq!(steps_left(&publication), want);

        // Once the lease is gone, the next retire removes step 2 too; complete and incomplete
        // steps are never touched, and retiring again is fine.
        lease.release().unwrap();
        let again = retire_step(&twelve).unwrap();
        assert_eq!(again.removed, vec![2]);
        assert!(publication.join("step-000013").is_dir());
        assert!(
            publication
                .join("step-000014")
                .join(MANIFEST_FILE)
                .is_file()
        );
    }
}
