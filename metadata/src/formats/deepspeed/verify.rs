//! Integrity of a DeepSpeed checkpoint's data: every storage record and pickle of every
//! torch.save file against the CRC-32 its zip directory records, streamed (bounded memory).

use futures::StreamExt;
use object_store::ObjectStore;
use object_store::path::Path;

use super::DeepSpeedDetails;
use super::torchfile::Record;
use crate::formats::dcp::BadBlob;
use crate::formats::dcp::stream_crc32;
use crate::formats::native::resolve;
use crate::{CheckpointMeta, MetadataError};

/// What [`verify_deepspeed`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeepSpeedVerifyReport {
    /// Records (storages and pickles) checked.
    pub records_checked: u64,
    /// Bytes read and checked.
    pub bytes_checked: u64,
    /// Every record whose bytes do not match.
    pub bad: Vec<BadBlob>,
}

impl DeepSpeedVerifyReport {
    /// True when nothing was wrong.
    pub fn is_ok(&self) -> bool {
        self.bad.is_empty()
    }
}

/// Reads every record of every file of the checkpoint (`meta` and `details` as
/// [`super::open_deepspeed`] gave them, opened from `prefix`) and checks its CRC-32,
/// `concurrency` reads at a time. Mismatches are collected; storage failures are errors.
pub async fn verify_deepspeed(
    store: &dyn ObjectStore,
    prefix: &Path,
    meta: &CheckpointMeta,
    details: &DeepSpeedDetails,
    concurrency: usize,
) -> Result<DeepSpeedVerifyReport, MetadataError> {
    let files = meta.files();
    let outcomes: Vec<Result<(u64, Option<BadBlob>), MetadataError>> =
        futures::stream::iter(details.records.iter().map(|(file, record)| {
            let name = files.get(*file as usize).map(|f| f.path.clone());
            async move {
                let Some(name) = name else {
                    return Err(MetadataError::Invalid {
                        what: format!("record {} names file #{file}", record.member),
                    });
                };
                check(store, prefix, &name, record).await
            }
        }))
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let mut report = DeepSpeedVerifyReport::default();
    for outcome in outcomes {
        let (bytes, bad) = outcome?;
        report.bytes_checked += bytes;
        report.records_checked += 1;
        report.bad.extend(bad);
    }
    report
        .bad
        .sort_by(|a, b| (&a.file, a.start).cmp(&(&b.file, b.start)));
    Ok(report)
}

async fn check(
    store: &dyn ObjectStore,
    prefix: &Path,
    file: &str,
    record: &Record,
) -> Result<(u64, Option<BadBlob>), MetadataError> {
    let path = resolve(prefix, file)?;
    let (start, end) = (record.range.start, record.range.end);
    let (read, actual) = stream_crc32(store, &path, start..end).await?;
    if read == end - start && actual == record.crc32 {
        return Ok((read, None));
    }
    let detail = if read != end - start {
        format!("read {read} of {} bytes", end - start)
    } else {
        format!(
            "crc32 {actual:08x} but the zip records {:08x}",
            record.crc32
        )
    };
    Ok((
        read,
        Some(BadBlob {
            file: file.to_string(),
            entry: record.member.clone(),
            start,
            end,
            detail,
        }),
    ))
}
