//! The typed records a rank's memory crosses the Python boundary as: a state-dict entry to load
//! into ([`LoadTarget`]) and a box a save holds ([`HeldBox`]). Python builds them by keyword, one
//! per entry, so each field is named where it is set instead of being a position in a wide tuple;
//! a field of the wrong type, or a required one missing, is refused when the record is built with
//! a `TypeError` naming the entry (its fqn) and the field. They are frozen: what was checked is
//! what crosses.

use pyo3::conversion::FromPyObjectOwned;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

/// A value's type and (shortened) repr, for an error about it.
fn described(value: &Bound<'_, PyAny>) -> String {
    let kind = value
        .get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string());
    let mut text = value
        .repr()
        .map_or_else(|_| "?".to_string(), |r| r.to_string());
    // A large list or a long string would bury the message that names the field.
    if text.chars().count() > 60 {
        text = text.chars().take(57).collect::<String>() + "...";
    }
    format!("{kind} {text}")
}

/// The entry whose record is being built, for the errors of its fields.
struct Entry<'a> {
    record: &'static str,
    fqn: &'a str,
}

impl<'a> Entry<'a> {
    /// The entry named by `fqn`, which must be a string (every other error names it).
    fn named(record: &'static str, fqn: &'a Bound<'_, PyAny>) -> PyResult<String> {
        fqn.extract::<String>().map_err(|_| {
            PyTypeError::new_err(format!(
                "a {record}'s field 'fqn' must be a str, not {}",
                described(fqn)
            ))
        })
    }

    /// A field that may be left out (absent or `None`).
    fn optional<'py, T: FromPyObjectOwned<'py>>(
        &self,
        name: &str,
        value: Option<&Bound<'py, PyAny>>,
        expect: &str,
    ) -> PyResult<Option<T>> {
        match value {
            None => Ok(None),
            Some(v) if v.is_none() => Ok(None),
            Some(v) => v.extract::<T>().map(Some).map_err(|error| {
                let cause: PyErr = error.into();
                PyTypeError::new_err(format!(
                    "entry '{}': field '{name}' of its {} must be {expect}, not {} ({cause})",
                    self.fqn,
                    self.record,
                    described(v)
                ))
            }),
        }
    }

    /// A field every record of the kind has.
    fn required<'py, T: FromPyObjectOwned<'py>>(
        &self,
        name: &str,
        value: Option<&Bound<'py, PyAny>>,
        expect: &str,
    ) -> PyResult<T> {
        self.optional(name, value, expect)?.ok_or_else(|| {
            PyTypeError::new_err(format!(
                "entry '{}': field '{name}' is missing (a {} needs {expect})",
                self.fqn, self.record
            ))
        })
    }
}

const DIMS: &str = "a list of non-negative ints";
const COUNT: &str = "a non-negative int";

/// One entry of a state dict to load into: `nbytes` bytes at `address` that hold `shape`
/// elements of `dtype`: the whole tensor `fqn`, or with `offsets` the box of that shape at those
/// offsets, or with `flat_start` the flat range `[flat_start, flat_start + numel)`.
/// `cuda_device`: the ordinal of the CUDA device the memory is on (`None`: host memory).
#[pyclass(frozen, get_all, module = "tessera._tessera", from_py_object)]
#[derive(Clone, Debug)]
pub struct LoadTarget {
    pub(crate) fqn: String,
    pub(crate) dtype: String,
    pub(crate) shape: Vec<u64>,
    pub(crate) offsets: Option<Vec<u64>>,
    pub(crate) flat_start: Option<u64>,
    pub(crate) address: usize,
    pub(crate) nbytes: usize,
    pub(crate) cuda_device: Option<u32>,
}

#[pymethods]
impl LoadTarget {
    /// Every field by keyword. The required ones default to `None` here only so that a missing
    /// one is refused naming the entry; the signature Python shows says which are required.
    #[new]
    #[pyo3(
        signature = (*, fqn, dtype=None, shape=None, offsets=None, flat_start=None, address=None, nbytes=None, cuda_device=None),
        text_signature = "(*, fqn, dtype, shape, address, nbytes, offsets=None, flat_start=None, cuda_device=None)"
    )]
    #[allow(clippy::too_many_arguments)] // one keyword per field: the record's whole point
    fn new(
        fqn: &Bound<'_, PyAny>,
        dtype: Option<&Bound<'_, PyAny>>,
        shape: Option<&Bound<'_, PyAny>>,
        offsets: Option<&Bound<'_, PyAny>>,
        flat_start: Option<&Bound<'_, PyAny>>,
        address: Option<&Bound<'_, PyAny>>,
        nbytes: Option<&Bound<'_, PyAny>>,
        cuda_device: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let name = Entry::named("LoadTarget", fqn)?;
        let entry = Entry {
            record: "LoadTarget",
            fqn: &name,
        };
        Ok(Self {
            dtype: entry.required("dtype", dtype, "a dtype name (str)")?,
            shape: entry.required("shape", shape, DIMS)?,
            offsets: entry.optional("offsets", offsets, DIMS)?,
            flat_start: entry.optional("flat_start", flat_start, COUNT)?,
            address: entry.required("address", address, "a memory address (int)")?,
            nbytes: entry.required("nbytes", nbytes, COUNT)?,
            cuda_device: entry.optional(
                "cuda_device",
                cuda_device,
                "a CUDA device ordinal (int)",
            )?,
            fqn: name,
        })
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

/// One box of a tensor a saving rank holds: `lengths` elements at `offsets` of the tensor `fqn`
/// of shape `global_shape`, C-contiguous at `address` (`nbytes` bytes), which the save only reads.
#[pyclass(frozen, get_all, module = "tessera._tessera", from_py_object)]
#[derive(Clone, Debug)]
pub struct HeldBox {
    pub(crate) fqn: String,
    pub(crate) dtype: String,
    pub(crate) global_shape: Vec<u64>,
    pub(crate) offsets: Vec<u64>,
    pub(crate) lengths: Vec<u64>,
    pub(crate) address: usize,
    pub(crate) nbytes: usize,
}

#[pymethods]
impl HeldBox {
    /// Every field by keyword, each required (see [`LoadTarget::new`] for why they default).
    #[new]
    #[pyo3(
        signature = (*, fqn, dtype=None, global_shape=None, offsets=None, lengths=None, address=None, nbytes=None),
        text_signature = "(*, fqn, dtype, global_shape, offsets, lengths, address, nbytes)"
    )]
    fn new(
        fqn: &Bound<'_, PyAny>,
        dtype: Option<&Bound<'_, PyAny>>,
        global_shape: Option<&Bound<'_, PyAny>>,
        offsets: Option<&Bound<'_, PyAny>>,
        lengths: Option<&Bound<'_, PyAny>>,
        address: Option<&Bound<'_, PyAny>>,
        nbytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let name = Entry::named("HeldBox", fqn)?;
        let entry = Entry {
            record: "HeldBox",
            fqn: &name,
        };
        Ok(Self {
            dtype: entry.required("dtype", dtype, "a dtype name (str)")?,
            global_shape: entry.required("global_shape", global_shape, DIMS)?,
            offsets: entry.required("offsets", offsets, DIMS)?,
            lengths: entry.required("lengths", lengths, DIMS)?,
            address: entry.required("address", address, "a memory address (int)")?,
            nbytes: entry.required("nbytes", nbytes, COUNT)?,
            fqn: name,
        })
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}
