//! Arrow IPC form of a rank plan: one row per (piece, destination it lands in), with the source
//! read on the piece's first row (a piece the rank only relays has one row, destination null); the small per-rank context (files, tensors, destinations,
//! group members, totals) rides in the schema metadata as JSON. Exchange rounds are not stored:
//! they follow from the pieces' groups and readers and are rebuilt on decode.

use std::collections::BTreeMap;
use std::io::Cursor;
use std::sync::Arc;

use arrow_array::builder::{BooleanBuilder, ListBuilder, UInt32Builder, UInt64Builder};
use arrow_array::cast::AsArray;
use arrow_array::types::{UInt32Type, UInt64Type};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_ipc::reader::StreamReader;
use arrow_ipc::writer::StreamWriter;
use arrow_schema::{DataType, Field, Schema};
use serde::{Deserialize, Serialize};
use tessera_metadata::{TensorBox, TensorMeta};

use crate::rank_plan::exchanges_for;
use crate::{
    JointCheck, PiecePlacement, PlanError, RankDestination, RankPiece, RankPlan, RankSummary,
    SourceRead, StridedRuns,
};

const CONTEXT_KEY: &str = "tessera.rank_plan";

#[derive(Serialize, Deserialize)]
struct Context {
    rank: u32,
    world: u32,
    files: Vec<String>,
    tensors: Vec<TensorMeta>,
    destinations: Vec<RankDestination>,
    groups: BTreeMap<u32, Vec<u32>>,
    summary: RankSummary,
    /// The plan's checkpoint identity; absent in streams written before identities existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    checkpoint_identity: Option<String>,
    /// Joint checks; absent in streams written before they existed (and when there are none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    joint_checks: Vec<JointCheck>,
}

fn arrow_err(e: impl std::fmt::Display) -> PlanError {
    PlanError::Arrow {
        detail: e.to_string(),
    }
}

fn u64_list() -> DataType {
    DataType::List(Arc::new(Field::new("item", DataType::UInt64, true)))
}

/// Column builders for one side of [`StridedRuns`].
struct RunsColumns {
    run_bytes: UInt64Builder,
    counts: ListBuilder<UInt64Builder>,
    src_offset: UInt64Builder,
    src_strides: ListBuilder<UInt64Builder>,
    dst_offset: UInt64Builder,
    dst_strides: ListBuilder<UInt64Builder>,
}

impl RunsColumns {
    fn new() -> Self {
        Self {
            run_bytes: UInt64Builder::new(),
            counts: ListBuilder::new(UInt64Builder::new()),
            src_offset: UInt64Builder::new(),
            src_strides: ListBuilder::new(UInt64Builder::new()),
            dst_offset: UInt64Builder::new(),
            dst_strides: ListBuilder::new(UInt64Builder::new()),
        }
    }

    fn append(&mut self, runs: Option<&StridedRuns>) {
        match runs {
            Some(r) => {
                self.run_bytes.append_value(r.run_bytes);
                self.counts.values().append_slice(&r.counts);
                self.counts.append(true);
                self.src_offset.append_value(r.src_offset);
                self.src_strides.values().append_slice(&r.src_strides);
                self.src_strides.append(true);
                self.dst_offset.append_value(r.dst_offset);
                self.dst_strides.values().append_slice(&r.dst_strides);
                self.dst_strides.append(true);
            }
            None => {
                self.run_bytes.append_null();
                self.counts.append(false);
                self.src_offset.append_null();
                self.src_strides.append(false);
                self.dst_offset.append_null();
                self.dst_strides.append(false);
            }
        }
    }

    fn fields(prefix: &str) -> Vec<Field> {
        vec![
            Field::new(format!("{prefix}_run_bytes"), DataType::UInt64, true),
            Field::new(format!("{prefix}_counts"), u64_list(), true),
            Field::new(format!("{prefix}_src_offset"), DataType::UInt64, true),
            Field::new(format!("{prefix}_src_strides"), u64_list(), true),
            Field::new(format!("{prefix}_dst_offset"), DataType::UInt64, true),
            Field::new(format!("{prefix}_dst_strides"), u64_list(), true),
        ]
    }

    fn finish(mut self) -> Vec<ArrayRef> {
        vec![
            Arc::new(self.run_bytes.finish()),
            Arc::new(self.counts.finish()),
            Arc::new(self.src_offset.finish()),
            Arc::new(self.src_strides.finish()),
            Arc::new(self.dst_offset.finish()),
            Arc::new(self.dst_strides.finish()),
        ]
    }
}

impl RankPlan {
    /// Encodes the plan as an Arrow IPC stream.
    pub fn to_arrow_ipc(&self) -> Result<Vec<u8>, PlanError> {
        let mut piece = UInt32Builder::new();
        let mut tensor = UInt32Builder::new();
        let mut offsets = ListBuilder::new(UInt64Builder::new());
        let mut lengths = ListBuilder::new(UInt64Builder::new());
        let mut bytes = UInt64Builder::new();
        let mut group = UInt32Builder::new();
        let mut reader = UInt32Builder::new();
        let mut by_holders = BooleanBuilder::new();
        let mut read_file = UInt32Builder::new();
        let mut read = RunsColumns::new();
        let mut destination = UInt32Builder::new();
        let mut place = RunsColumns::new();
        for p in &self.pieces {
            // A relayed piece lands nowhere: one row with a null destination carries its read.
            let rows: Vec<Option<&PiecePlacement>> = if p.places.is_empty() {
                vec![None]
            } else {
                p.places.iter().map(Some).collect()
            };
            for (i, placement) in rows.into_iter().enumerate() {
                piece.append_value(p.id);
                tensor.append_value(p.tensor);
                offsets.values().append_slice(&p.region.offsets);
                offsets.append(true);
                lengths.values().append_slice(&p.region.lengths);
                lengths.append(true);
                bytes.append_value(p.bytes);
                group.append_value(p.group);
                reader.append_value(p.reader);
                by_holders.append_value(p.read_by_holders);
                let source = if i == 0 { p.read.as_ref() } else { None };
                read_file.append_option(source.map(|s| s.file));
                read.append(source.map(|s| &s.runs));
                destination.append_option(placement.map(|p| p.destination));
                place.append(placement.map(|p| &p.runs));
            }
        }
        let mut groups = BTreeMap::new();
        for e in &self.exchanges {
            groups.insert(e.group, e.members.clone());
        }
        let context = Context {
            rank: self.rank,
            world: self.world,
            files: self.files.clone(),
            tensors: self.tensors.clone(),
            destinations: self.destinations.clone(),
            groups,
            summary: self.summary.clone(),
            checkpoint_identity: self.checkpoint_identity.clone(),
            joint_checks: self.joint_checks.clone(),
        };
        let mut fields = vec![
            Field::new("piece", DataType::UInt32, false),
            Field::new("tensor", DataType::UInt32, false),
            Field::new("offsets", u64_list(), false),
            Field::new("lengths", u64_list(), false),
            Field::new("bytes", DataType::UInt64, false),
            Field::new("group", DataType::UInt32, false),
            Field::new("reader", DataType::UInt32, false),
            Field::new("read_by_holders", DataType::Boolean, false),
            Field::new("read_file", DataType::UInt32, true),
        ];
        fields.extend(RunsColumns::fields("read"));
        fields.push(Field::new("destination", DataType::UInt32, true));
        fields.extend(RunsColumns::fields("place"));
        let metadata: std::collections::HashMap<String, String> = [(
            CONTEXT_KEY.to_string(),
            serde_json::to_string(&context).map_err(arrow_err)?,
        )]
        .into_iter()
        .collect();
        let schema = Arc::new(Schema::new_with_metadata(fields, metadata));
        let mut columns: Vec<ArrayRef> = vec![
            Arc::new(piece.finish()),
            Arc::new(tensor.finish()),
            Arc::new(offsets.finish()),
            Arc::new(lengths.finish()),
            Arc::new(bytes.finish()),
            Arc::new(group.finish()),
            Arc::new(reader.finish()),
            Arc::new(by_holders.finish()),
            Arc::new(read_file.finish()),
        ];
        columns.extend(read.finish());
        columns.push(Arc::new(destination.finish()));
        columns.extend(place.finish());
        let batch = RecordBatch::try_new(Arc::clone(&schema), columns).map_err(arrow_err)?;
        let mut out = Vec::new();
        let mut writer = StreamWriter::try_new(&mut out, &schema).map_err(arrow_err)?;
        writer.write(&batch).map_err(arrow_err)?;
        writer.finish().map_err(arrow_err)?;
        drop(writer);
        Ok(out)
    }

    /// Decodes a plan written by [`RankPlan::to_arrow_ipc`].
    pub fn from_arrow_ipc(data: &[u8]) -> Result<RankPlan, PlanError> {
        let reader = StreamReader::try_new(Cursor::new(data), None).map_err(arrow_err)?;
        let schema = reader.schema();
        let Some(context) = schema.metadata().get(CONTEXT_KEY) else {
            return Err(arrow_err(format!(
                "schema metadata {CONTEXT_KEY} is missing"
            )));
        };
        let context: Context = serde_json::from_str(context).map_err(arrow_err)?;
        let mut pieces: Vec<RankPiece> = Vec::new();
        for batch in reader {
            let batch = batch.map_err(arrow_err)?;
            decode_batch(&batch, &mut pieces)?;
        }
        let group_ids: Vec<u32> = context.groups.keys().copied().collect();
        let exchanges = exchanges_for(
            context.rank,
            |g| context.groups.get(&g).cloned().unwrap_or_default(),
            |g| {
                let mut list: Vec<(u32, u32, u64)> = pieces
                    .iter()
                    .filter(|p| p.group == g && !p.read_by_holders)
                    .map(|p| (p.id, p.reader, p.bytes))
                    .collect();
                list.sort_by_key(|e| (e.1, e.0));
                list
            },
            &group_ids,
        );
        Ok(RankPlan {
            rank: context.rank,
            world: context.world,
            files: context.files,
            tensors: context.tensors,
            destinations: context.destinations,
            pieces,
            exchanges,
            summary: context.summary,
            checkpoint_identity: context.checkpoint_identity,
            joint_checks: context.joint_checks,
        })
    }
}

fn column<'a>(batch: &'a RecordBatch, name: &str) -> Result<&'a ArrayRef, PlanError> {
    batch
        .column_by_name(name)
        .ok_or_else(|| arrow_err(format!("column {name} is missing")))
}

fn u32_col<'a>(
    batch: &'a RecordBatch,
    name: &str,
) -> Result<&'a arrow_array::UInt32Array, PlanError> {
    column(batch, name)?
        .as_primitive_opt::<UInt32Type>()
        .ok_or_else(|| arrow_err(format!("column {name} is not u32")))
}

fn u64_col<'a>(
    batch: &'a RecordBatch,
    name: &str,
) -> Result<&'a arrow_array::UInt64Array, PlanError> {
    column(batch, name)?
        .as_primitive_opt::<UInt64Type>()
        .ok_or_else(|| arrow_err(format!("column {name} is not u64")))
}

fn list_value(batch: &RecordBatch, name: &str, row: usize) -> Result<Vec<u64>, PlanError> {
    let list = column(batch, name)?
        .as_list_opt::<i32>()
        .ok_or_else(|| arrow_err(format!("column {name} is not a list")))?;
    let values = list.value(row);
    let values = values
        .as_primitive_opt::<UInt64Type>()
        .ok_or_else(|| arrow_err(format!("column {name} does not hold u64")))?;
    Ok(values.values().to_vec())
}

fn runs_at(
    batch: &RecordBatch,
    prefix: &str,
    row: usize,
) -> Result<Option<StridedRuns>, PlanError> {
    let run_bytes = u64_col(batch, &format!("{prefix}_run_bytes"))?;
    if run_bytes.is_null(row) {
        return Ok(None);
    }
    Ok(Some(StridedRuns {
        run_bytes: run_bytes.value(row),
        counts: list_value(batch, &format!("{prefix}_counts"), row)?,
        src_offset: u64_col(batch, &format!("{prefix}_src_offset"))?.value(row),
        src_strides: list_value(batch, &format!("{prefix}_src_strides"), row)?,
        dst_offset: u64_col(batch, &format!("{prefix}_dst_offset"))?.value(row),
        dst_strides: list_value(batch, &format!("{prefix}_dst_strides"), row)?,
    }))
}

fn decode_batch(batch: &RecordBatch, pieces: &mut Vec<RankPiece>) -> Result<(), PlanError> {
    let piece = u32_col(batch, "piece")?;
    let tensor = u32_col(batch, "tensor")?;
    let bytes = u64_col(batch, "bytes")?;
    let group = u32_col(batch, "group")?;
    let reader = u32_col(batch, "reader")?;
    // Absent from streams written before small pieces could be read by every holder.
    let by_holders = match batch.column_by_name("read_by_holders") {
        Some(c) => Some(
            c.as_boolean_opt()
                .ok_or_else(|| arrow_err("column read_by_holders is not boolean"))?,
        ),
        None => None,
    };
    let read_file = u32_col(batch, "read_file")?;
    let destination = u32_col(batch, "destination")?;
    for row in 0..batch.num_rows() {
        let id = piece.value(row);
        let placement = if destination.is_null(row) {
            None
        } else {
            let place = runs_at(batch, "place", row)?
                .ok_or_else(|| arrow_err(format!("row {row}: place runs are null")))?;
            Some(PiecePlacement {
                destination: destination.value(row),
                runs: place,
            })
        };
        if let Some(last) = pieces.last_mut()
            && last.id == id
        {
            let Some(placement) = placement else {
                return Err(arrow_err(format!(
                    "row {row}: piece {id} has a second row without a destination"
                )));
            };
            last.places.push(placement);
            continue;
        }
        let read = match runs_at(batch, "read", row)? {
            Some(runs) if !read_file.is_null(row) => Some(SourceRead {
                file: read_file.value(row),
                runs,
            }),
            _ => None,
        };
        pieces.push(RankPiece {
            id,
            tensor: tensor.value(row),
            region: TensorBox::new(
                list_value(batch, "offsets", row)?,
                list_value(batch, "lengths", row)?,
            ),
            bytes: bytes.value(row),
            group: group.value(row),
            reader: reader.value(row),
            read,
            read_by_holders: by_holders.is_some_and(|c| c.value(row)),
            places: placement.into_iter().collect(),
        });
    }
    Ok(())
}
