//! Saved bytes that are stored encoded: a byte range of a data file that holds a compressed
//! stream (a DCP blob written with `FileSystemWriter(_extensions=[ZStandard()])`, whose metadata
//! names the transform `stream.zstd/1`). The checkpoint model shows each such range as a file of
//! its own ([`crate::DataFile::encoded`]) holding the *decoded* bytes, so that the planner and the
//! loader address the tensor bytes inside it as they would in a plain file; reads of it go through
//! a decoding view of the store, which decodes the range from its start (a compressed stream
//! cannot be entered in the middle).

use std::ops::Range;

use futures::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore};
use serde::{Deserialize, Serialize};

/// How an encoded range is encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    /// Zstandard: one or more frames (DCP's `stream.zstd/1`, written by the `zstandard` or
    /// `pyzstd` module).
    Zstd,
}

impl Codec {
    /// Its name in messages and in the names of decoded files.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Zstd => "zstd",
        }
    }

    /// The codec DCP's transform descriptors (`_StorageInfo.transform_descriptors`, applied in
    /// order when reading) stand for. DCP ships one stream transform, `stream.zstd` at major
    /// version 1 (its reader refuses other versions the same way); anything else is refused with
    /// the descriptors named.
    pub fn from_dcp_descriptors(descriptors: &[String]) -> Result<Codec, String> {
        match descriptors {
            [one] => {
                let (name, version) = one.split_once('/').unwrap_or((one.as_str(), ""));
                match (name, version.split('.').next()) {
                    ("stream.zstd", Some("1")) => Ok(Codec::Zstd),
                    ("stream.zstd", _) => Err(format!(
                        "transform {one}: DCP's ZStandard extension is version 1; this blob needs version {version:?}"
                    )),
                    _ => Err(format!(
                        "transform {one} is not one DCP ships (tessera reads stream.zstd/1)"
                    )),
                }
            }
            _ => Err(format!(
                "transforms [{}]: tessera reads blobs with one transform, stream.zstd/1",
                descriptors.join(", ")
            )),
        }
    }
}

/// A byte range of a real data file that holds an encoded stream.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EncodedRange {
    /// The real file, relative to the checkpoint root.
    pub source: String,
    /// First byte of the stream in it.
    pub offset: u64,
    /// Bytes of the stream.
    pub length: u64,
    /// How the stream is encoded.
    pub codec: Codec,
}

impl EncodedRange {
    /// The name the decoded bytes go by in the checkpoint model: the source file's name with the
    /// range and codec after it (`__0_0.distcp@1024+5000.zstd`), so messages say where they come
    /// from. DCP names its files `__<rank>_<n>.distcp`, never with an `@`.
    pub fn file_name(&self) -> String {
        format!(
            "{}@{}+{}.{}",
            self.source,
            self.offset,
            self.length,
            self.codec.name()
        )
    }
}

/// Decoded bytes are handed on in stretches of at most this many bytes (zstd's recommended
/// output buffer, one block).
const OUT_CHUNK: usize = 128 << 10;

/// A streaming decoder: compressed bytes go in as they arrive, decoded bytes come out in order
/// with their offset in the decoded stream. Memory is one output stretch, whatever the stream's
/// size, so indexing a large blob or a highly compressed one (a tensor of zeros) holds only what
/// the caller keeps.
pub struct Decoder {
    inner: zstd::stream::raw::Decoder<'static>,
    out: Vec<u8>,
    decoded: u64,
    /// The last frame ended and nothing of another one has been fed since.
    at_frame_end: bool,
    fed: bool,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("decoded", &self.decoded)
            .field("at_frame_end", &self.at_frame_end)
            .finish()
    }
}

impl Decoder {
    /// A decoder for `codec`.
    pub fn new(codec: Codec) -> Result<Decoder, String> {
        match codec {
            Codec::Zstd => Ok(Decoder {
                inner: zstd::stream::raw::Decoder::new()
                    .map_err(|e| format!("cannot start a zstd decoder: {e}"))?,
                out: vec![0; OUT_CHUNK],
                decoded: 0,
                at_frame_end: false,
                fed: false,
            }),
        }
    }

    /// Bytes decoded so far.
    pub fn decoded(&self) -> u64 {
        self.decoded
    }

    /// Decodes `input` (the next compressed bytes), handing each decoded stretch to
    /// `sink(offset, bytes)`. The sink returns `false` when it has all it wants: decoding stops
    /// there and this returns `Ok(false)`.
    pub fn feed(
        &mut self,
        input: &[u8],
        sink: &mut (dyn FnMut(u64, &[u8]) -> bool + Send),
    ) -> Result<bool, String> {
        use zstd::stream::raw::{InBuffer, Operation, OutBuffer};
        let mut input = InBuffer::around(input);
        loop {
            let before = input.pos;
            let mut output = OutBuffer::around(&mut self.out[..]);
            let hint = self
                .inner
                .run(&mut input, &mut output)
                .map_err(|e| format!("not a valid zstd stream: {e}"))?;
            let produced = output.pos();
            let consumed = input.pos > before;
            // `run` returns 0 when a frame is complete and wholly flushed. A call that consumed
            // and produced nothing (draining after a full output buffer) says nothing new: the
            // decoder then waits for the next frame's header.
            if consumed || produced > 0 {
                self.fed = true;
                self.at_frame_end = hint == 0;
            }
            if produced > 0 {
                let offset = self.decoded;
                self.decoded += produced as u64;
                if !sink(offset, &self.out[..produced]) {
                    return Ok(false);
                }
            }
            // More output may be pending while the output buffer came back full.
            if input.pos >= input.src.len() && produced < self.out.len() {
                return Ok(true);
            }
        }
    }

    /// Ends the stream: checks that it ended where a frame does (a truncated blob does not) and
    /// returns the decoded length.
    pub fn finish(self) -> Result<u64, String> {
        if !self.fed {
            return Err("the stream is empty".to_string());
        }
        if !self.at_frame_end {
            return Err(format!(
                "the stream ends inside a zstd frame after {} decoded bytes (truncated?)",
                self.decoded
            ));
        }
        Ok(self.decoded)
    }
}

/// Why [`decode_from_store`] failed.
#[derive(Debug)]
pub enum DecodeFailure {
    /// The store failed to read the range.
    Store(object_store::Error),
    /// The bytes are not a whole stream of the codec, or the store returned fewer than asked.
    Invalid(String),
}

/// Streams the encoded `range` of `path` from `store` through a [`Decoder`] into `sink` (as
/// [`Decoder::feed`]). Returns the decoded length when the stream was decoded to its end, `None`
/// when the sink stopped it. Memory: the store's stream parts in flight and one output stretch.
pub async fn decode_from_store(
    store: &dyn ObjectStore,
    path: &Path,
    range: Range<u64>,
    codec: Codec,
    sink: &mut (dyn FnMut(u64, &[u8]) -> bool + Send),
) -> Result<Option<u64>, DecodeFailure> {
    let mut decoder = Decoder::new(codec).map_err(DecodeFailure::Invalid)?;
    let want = range.end - range.start;
    let result = store
        .get_opts(
            path,
            GetOptions {
                range: Some(GetRange::Bounded(range)),
                ..GetOptions::default()
            },
        )
        .await
        .map_err(DecodeFailure::Store)?;
    let mut stream = result.into_stream();
    let mut got = 0u64;
    while let Some(part) = stream.next().await {
        let part = part.map_err(DecodeFailure::Store)?;
        got += part.len() as u64;
        if !decoder.feed(&part, sink).map_err(DecodeFailure::Invalid)? {
            return Ok(None);
        }
    }
    if got != want {
        return Err(DecodeFailure::Invalid(format!(
            "the store returned {got} of its {want} bytes (truncated file?)"
        )));
    }
    decoder.finish().map(Some).map_err(DecodeFailure::Invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(data: &[u8]) -> Vec<u8> {
        zstd::bulk::compress(data, 3).expect("compress")
    }

    fn decode_all(compressed: &[u8], feed_size: usize) -> Result<Vec<u8>, String> {
        let mut decoder = Decoder::new(Codec::Zstd)?;
        let mut out = Vec::new();
        for part in compressed.chunks(feed_size.max(1)) {
            decoder.feed(part, &mut |offset, bytes| {
                assert_eq!(offset, out.len() as u64);
                out.extend_from_slice(bytes);
                true
            })?;
        }
        let len = decoder.finish()?;
        assert_eq!(len, out.len() as u64);
        Ok(out)
    }

    fn sample(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[test]
    fn decodes_fed_in_any_cuts_and_across_frames() {
        let data = sample(700_000);
        let one = encode(&data);
        for feed in [1, 17, 4096, one.len()] {
            assert_eq!(decode_all(&one, feed).expect("decodes"), data);
        }
        // Two frames back to back decode as their concatenation.
        let mut two = encode(&data[..300_000]);
        two.extend(encode(&data[300_000..]));
        assert_eq!(decode_all(&two, 5000).expect("decodes"), data);
        // A stream of zeros far larger than its compressed form is decoded in bounded stretches.
        let zeros = vec![0u8; 8 << 20];
        let packed = encode(&zeros);
        assert!(packed.len() < 4096, "{}", packed.len());
        let mut decoder = Decoder::new(Codec::Zstd).expect("decoder");
        let mut largest = 0;
        decoder
            .feed(&packed, &mut |_, bytes| {
                largest = largest.max(bytes.len());
                bytes.iter().all(|&b| b == 0)
            })
            .expect("decodes");
        assert_eq!(decoder.finish().expect("ends"), zeros.len() as u64);
        assert!(largest <= OUT_CHUNK);
    }

    #[test]
    fn a_sink_that_has_enough_stops_decoding() {
        let data = sample(1 << 20);
        let packed = encode(&data);
        let mut decoder = Decoder::new(Codec::Zstd).expect("decoder");
        let mut got = 0u64;
        let more = decoder
            .feed(&packed, &mut |_, bytes| {
                got += bytes.len() as u64;
                got < 200_000
            })
            .expect("decodes");
        assert!(!more);
        assert!(got >= 200_000 && decoder.decoded() < data.len() as u64);
    }

    #[test]
    fn truncated_damaged_and_empty_streams_are_errors() {
        let data = sample(300_000);
        let packed = encode(&data);
        let err = decode_all(&packed[..packed.len() - 10], 4096).expect_err("truncated");
        assert!(err.contains("ends inside a zstd frame"), "{err}");
        let mut bad = packed.clone();
        bad[0] ^= 0xff;
        let err = decode_all(&bad, 4096).expect_err("bad magic");
        assert!(err.contains("not a valid zstd stream"), "{err}");
        let err = decode_all(&[], 4096).expect_err("empty");
        assert!(err.contains("empty"), "{err}");
    }

    #[test]
    fn dcp_descriptors_name_what_is_refused() {
        let d = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            Codec::from_dcp_descriptors(&d(&["stream.zstd/1"])),
            Ok(Codec::Zstd)
        );
        assert_eq!(
            Codec::from_dcp_descriptors(&d(&["stream.zstd/1.2"])),
            Ok(Codec::Zstd)
        );
        let err = Codec::from_dcp_descriptors(&d(&["stream.zstd/2"])).expect_err("v2");
        assert!(err.contains("version 1"), "{err}");
        let err = Codec::from_dcp_descriptors(&d(&["stream.aes/1"])).expect_err("other");
        assert!(err.contains("stream.aes/1"), "{err}");
        let err =
            Codec::from_dcp_descriptors(&d(&["stream.zstd/1", "stream.zstd/1"])).expect_err("two");
        assert!(err.contains("one transform"), "{err}");
    }

    #[test]
    fn a_decoded_file_is_named_after_its_source() {
        let range = EncodedRange {
            source: "__0_0.distcp".into(),
            offset: 1024,
            length: 5000,
            codec: Codec::Zstd,
        };
        assert_eq!(range.file_name(), "__0_0.distcp@1024+5000.zstd");
    }
}
