//! [`DecodedStore`]: the view of a checkpoint's store in which the files its model marks encoded
//! ([`DataFile::encoded`], a DCP blob saved compressed) read as their decoded bytes, so that the
//! range scheduler, verification and object reads work on them as on any file.
//!
//! A compressed stream cannot be entered in the middle, so the first read of such a file decodes
//! it from its start up to its last readable byte (the end of the tensor's storage) once, and the
//! decoded bytes are kept for the reads that follow: the scheduler asks for a file's parts in
//! order, so they hit. Readers of one file wait for one decode. Decoded files are kept up to a
//! byte budget, least recently used first out; the file being read is always kept, so memory is
//! the budget plus one decoded blob (one tensor chunk's storage).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, GetResult, GetResultPayload, ObjectMeta, ObjectStore};
use tessera_metadata::DataFile;
use tessera_metadata::encoded::{Codec, DecodeFailure, decode_from_store};
use tokio::sync::OnceCell;

use crate::read::overlay::{Overlay, OverlayStore};

/// Decoded bytes kept for later reads, beyond the file being read (1 GiB).
pub const DECODED_CACHE_BYTES: u64 = 1 << 30;

/// One encoded file of the model, as the store finds it.
#[derive(Debug)]
struct DecodedFile {
    /// The real file holding the stream.
    source: Path,
    /// The stream's bytes in it.
    range: Range<u64>,
    codec: Codec,
    /// Decoded bytes that can be read: the file's size in the model.
    visible: u64,
}

type Decoded = Arc<OnceCell<Bytes>>;

#[derive(Debug, Default)]
struct Kept {
    /// Least recently used first.
    entries: VecDeque<(Path, Decoded, u64)>,
    bytes: u64,
}

/// An [`ObjectStore`] that reads a checkpoint's encoded files as their decoded bytes and passes
/// everything else to the store beneath. Writes to an encoded file's name are refused.
#[derive(Debug)]
pub struct DecodedStore {
    inner: Arc<dyn ObjectStore>,
    files: HashMap<Path, DecodedFile>,
    kept: Mutex<Kept>,
    budget: u64,
}

impl fmt::Display for DecodedStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Decoded({}, {} files)", self.inner, self.files.len())
    }
}

impl DecodedStore {
    /// The view of `inner` for the model's `files` whose paths resolve under `prefix` by
    /// `resolve`; `None` when no file is encoded (the store is then used as it is).
    pub fn for_files(
        inner: Arc<dyn ObjectStore>,
        files: &[DataFile],
        resolve: impl Fn(&str) -> Result<Path, crate::LoaderError>,
        budget: u64,
    ) -> Result<Option<OverlayStore<DecodedStore>>, crate::LoaderError> {
        let mut decoded = HashMap::new();
        for file in files {
            let Some(encoded) = &file.encoded else {
                continue;
            };
            decoded.insert(
                resolve(&file.path)?,
                DecodedFile {
                    source: resolve(&encoded.source)?,
                    range: encoded.offset..encoded.offset.saturating_add(encoded.length),
                    codec: encoded.codec,
                    visible: file.size.unwrap_or(0),
                },
            );
        }
        Ok((!decoded.is_empty()).then(|| {
            OverlayStore(DecodedStore {
                inner,
                files: decoded,
                kept: Mutex::new(Kept::default()),
                budget,
            })
        }))
    }

    /// The decoded bytes of `file` (named `location`), decoded now or by a reader before.
    async fn decoded(&self, location: &Path, file: &DecodedFile) -> object_store::Result<Bytes> {
        let cell = {
            let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
            match kept.entries.iter().position(|(p, _, _)| p == location) {
                Some(i) => {
                    let entry = kept.entries.remove(i).expect("index from position");
                    let cell = Arc::clone(&entry.1);
                    kept.entries.push_back(entry);
                    cell
                }
                None => {
                    let cell: Decoded = Arc::new(OnceCell::new());
                    kept.entries
                        .push_back((location.clone(), Arc::clone(&cell), file.visible));
                    kept.bytes += file.visible;
                    while kept.bytes > self.budget && kept.entries.len() > 1 {
                        if let Some((_, _, bytes)) = kept.entries.pop_front() {
                            kept.bytes -= bytes;
                        }
                    }
                    cell
                }
            }
        };
        cell.get_or_try_init(|| self.decode(location, file))
            .await
            .cloned()
    }

    async fn decode(&self, location: &Path, file: &DecodedFile) -> object_store::Result<Bytes> {
        let want = usize::try_from(file.visible).map_err(|_| {
            generic(format!(
                "{location}: {} decoded bytes do not fit in memory here",
                file.visible
            ))
        })?;
        let mut out: Vec<u8> = Vec::with_capacity(want);
        let mut sink = |_offset: u64, bytes: &[u8]| {
            let take = bytes.len().min(want - out.len());
            out.extend_from_slice(&bytes[..take]);
            out.len() < want
        };
        let what = || {
            format!(
                "{location} ({} bytes {}..{} of {})",
                file.codec.name(),
                file.range.start,
                file.range.end,
                file.source
            )
        };
        if want > 0 {
            match decode_from_store(
                self.inner.as_ref(),
                &file.source,
                file.range.clone(),
                file.codec,
                &mut sink,
            )
            .await
            {
                Ok(_) => {}
                Err(DecodeFailure::Store(e)) => return Err(e),
                Err(DecodeFailure::Invalid(detail)) => {
                    return Err(generic(format!("{}: {detail}", what())));
                }
            }
        }
        if out.len() != want {
            return Err(generic(format!(
                "{}: decodes to {} bytes but the checkpoint's index needs {want} (the file changed since it was opened?)",
                what(),
                out.len()
            )));
        }
        Ok(Bytes::from(out))
    }
}

fn generic(detail: String) -> object_store::Error {
    object_store::Error::Generic {
        store: "decoded",
        source: detail.into(),
    }
}

#[async_trait::async_trait]
impl Overlay for DecodedStore {
    fn inner(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    fn serves(&self, location: &Path) -> bool {
        self.files.contains_key(location)
    }

    async fn get_served(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let Some(file) = self.files.get(location) else {
            return Err(generic(format!(
                "{location} is not an encoded file of this view"
            )));
        };
        let meta = ObjectMeta {
            location: location.clone(),
            last_modified: Default::default(),
            size: file.visible,
            e_tag: None,
            version: None,
        };
        let size = file.visible;
        let range = match &options.range {
            None => 0..size,
            Some(GetRange::Bounded(r)) => r.clone(),
            Some(GetRange::Offset(start)) => *start..size,
            Some(GetRange::Suffix(n)) => size.saturating_sub(*n)..size,
        };
        if range.start > range.end || range.end > size {
            return Err(generic(format!(
                "{location}: bytes {}..{} asked for, but it has {size} decoded bytes",
                range.start, range.end
            )));
        }
        if options.head {
            return Ok(GetResult {
                payload: GetResultPayload::Stream(futures::stream::empty().boxed()),
                meta,
                range: 0..0,
                attributes: Default::default(),
                extensions: Default::default(),
            });
        }
        let bytes = self
            .decoded(location, file)
            .await?
            .slice(range.start as usize..range.end as usize);
        Ok(GetResult {
            payload: GetResultPayload::Stream(
                futures::stream::once(async move { Ok(bytes) }).boxed(),
            ),
            meta,
            range,
            attributes: Default::default(),
            extensions: Default::default(),
        })
    }

    fn refuse_write(&self, location: &Path) -> object_store::Error {
        generic(format!(
            "{location} stands for decoded bytes of a compressed blob and cannot be written"
        ))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;
    use object_store::memory::InMemory;
    use tessera_metadata::encoded::EncodedRange;

    fn store_with_blob(data: &[u8]) -> (Arc<dyn ObjectStore>, Vec<DataFile>) {
        let packed = zstd::bulk::compress(data, 3).unwrap();
        let mut file = b"0123456789".to_vec();
        file.extend_from_slice(&packed);
        file.extend_from_slice(b"trailing");
        let inner: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        futures::executor::block_on(inner.put(&Path::from("ck/a.distcp"), file.into())).unwrap();
        let range = EncodedRange {
            source: "a.distcp".into(),
            offset: 10,
            length: packed.len() as u64,
            codec: Codec::Zstd,
        };
        let files = vec![
            DataFile {
                path: "a.distcp".into(),
                size: None,
                encoded: None,
            },
            DataFile {
                path: range.file_name(),
                size: Some(data.len() as u64 - 100),
                encoded: Some(range),
            },
        ];
        (inner, files)
    }

    fn resolve(name: &str) -> Result<Path, crate::LoaderError> {
        Ok(Path::from(format!("ck/{name}")))
    }

    #[tokio::test]
    async fn encoded_files_read_as_their_decoded_bytes_and_others_pass_through() {
        let data: Vec<u8> = (0..500_000u32).map(|i| (i % 253) as u8).collect();
        let (inner, files) = store_with_blob(&data);
        let store = DecodedStore::for_files(Arc::clone(&inner), &files, resolve, 1 << 20)
            .unwrap()
            .unwrap();
        let decoded = resolve(&files[1].path).unwrap();
        assert_eq!(
            store.get_range(&decoded, 1000..2000).await.unwrap(),
            &data[1000..2000]
        );
        assert_eq!(
            store.get_range(&decoded, 0..400_000).await.unwrap(),
            &data[..400_000]
        );
        assert_eq!(store.head(&decoded).await.unwrap().size, 499_900);
        let err = store
            .get_range(&decoded, 499_000..500_000)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("499900 decoded bytes"), "{err}");
        assert_eq!(
            store
                .get_range(&Path::from("ck/a.distcp"), 0..10)
                .await
                .unwrap(),
            &b"0123456789"[..]
        );
        let err = store.put(&decoded, vec![1u8].into()).await.unwrap_err();
        assert!(err.to_string().contains("cannot be written"), "{err}");
        // No encoded file: no view.
        assert!(
            DecodedStore::for_files(inner, &files[..1], resolve, 1 << 20)
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn a_damaged_stream_fails_the_read_naming_the_source() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let (inner, files) = store_with_blob(&data);
        let mut bytes = inner
            .get(&Path::from("ck/a.distcp"))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap()
            .to_vec();
        bytes[12] ^= 0x5a;
        inner
            .put(&Path::from("ck/a.distcp"), bytes.into())
            .await
            .unwrap();
        let store = DecodedStore::for_files(inner, &files, resolve, 1 << 20)
            .unwrap()
            .unwrap();
        let err = store
            .get_range(&resolve(&files[1].path).unwrap(), 0..10)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("ck/a.distcp"), "{err}");
    }
}
