"""The Python boundary's limits (issue 42): what crosses into the native module `tessera._tessera`
crosses as typed records, and its surface stays narrow.

- No exported function, method or constructor takes more than 8 parameters (``self`` not
  counted): a wider call is a request that wants to be a typed record (``LoadRequest``,
  ``SaveRequest``). Read from the ``__text_signature__`` pyo3 writes, through
  ``inspect.signature``; a function whose signature cannot be read fails the test rather than
  escaping it.
- No exported class has more than 6 public methods. A method is a public name the class itself
  defines (``vars(cls)``, not what it inherits from ``object`` or ``Exception``) whose value is a
  routine (``inspect.isroutine``): something called, with arguments, to do a job. Attributes read
  without a call (a record's fields, ``#[getter]``s: pyo3 makes them data descriptors) are the
  class's data, not its jobs, and are not counted; dunders (``__new__``, ``__repr__``) are
  Python's protocol, not the class's API. A class over the limit is split along its jobs
  (``GroupLoad`` and ``GroupExchange``), never exempted here.
- State-dict entries (``LoadTarget``), a save's held boxes (``HeldBox``) and the exchange's and
  job's actions (``ExchangeAction``, ``JobAction``) are typed records: a tuple where a record is
  expected is refused naming the parameter, and a record with a field of the wrong type or
  missing is refused naming the entry and the field.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import tessera
from conftest import fixture
from tessera import _tessera

C = "c_w4_dp2_tp2"
MAX_PARAMETERS = 8
MAX_METHODS = 6


def _classes():
    return {name: obj for name, obj in vars(_tessera).items() if inspect.isclass(obj)}


def _functions():
    return {name: obj for name, obj in vars(_tessera).items() if inspect.isbuiltin(obj)}


def _methods(cls) -> list:
    """The class's public methods by the rule in the module docstring."""
    return sorted(name for name, attr in vars(cls).items() if not name.startswith("_") and inspect.isroutine(attr))


def _parameters(function) -> list:
    """The names of ``function``'s parameters, ``self`` not counted."""
    return [p for p in inspect.signature(function).parameters if p != "self"]


def test_the_rules_see_the_whole_module():
    # The limits below hold only if they look at everything: the module's functions and classes
    # are found, methods are counted (GroupLoad's), and fields are not (LoadTarget's).
    functions, classes = _functions(), _classes()
    assert {"load_into", "group_load", "save", "plan", "open_checkpoint"} <= set(functions)
    assert {"LoadTarget", "HeldBox", "LoadRequest", "SaveRequest", "GroupLoad", "GroupExchange",
            "ExchangeAction", "JobAction", "OpenedCheckpoint"} <= set(classes)
    assert {"read", "finish", "exchange"} <= set(_methods(_tessera.GroupLoad))
    assert _methods(_tessera.LoadTarget) == []
    assert "fqn" in vars(_tessera.LoadTarget)
    assert _parameters(_tessera.load_into) == ["checkpoint", "targets", "request", "progress"]


def test_no_exported_function_takes_more_than_eight_parameters():
    wide = {}
    for name, function in _functions().items():
        params = _parameters(function)
        if len(params) > MAX_PARAMETERS:
            wide[name] = params
    for cls_name, cls in _classes().items():
        # A class built only by the module (ExchangeAction, GroupLoad) has no constructor and so
        # no signature; one Python builds (LoadTarget, LoadRequest) has its constructor's.
        if cls.__text_signature__ is not None:
            params = _parameters(cls)
            if len(params) > MAX_PARAMETERS:
                wide[cls_name] = params
        for method in _methods(cls):
            params = _parameters(getattr(cls, method))
            if len(params) > MAX_PARAMETERS:
                wide[f"{cls_name}.{method}"] = params
    assert wide == {}, f"more than {MAX_PARAMETERS} parameters: pass a typed record instead"


def test_no_exported_class_has_more_than_six_public_methods():
    broad = {name: _methods(cls) for name, cls in _classes().items() if len(_methods(cls)) > MAX_METHODS}
    assert broad == {}, f"more than {MAX_METHODS} public methods: split the class along its jobs"


def _target(**fields):
    a = np.empty(64, np.float32)
    base = dict(fqn="model.final_ln.weight", dtype="float32", shape=[64], address=a.ctypes.data, nbytes=a.nbytes)
    base.update(fields)
    return _tessera.LoadTarget(**base), a


def _held_box(**fields):
    a = np.arange(4, dtype=np.float32)
    base = dict(fqn="w", dtype="float32", global_shape=[4], offsets=[0], lengths=[4], address=a.ctypes.data,
                nbytes=a.nbytes)
    base.update(fields)
    return _tessera.HeldBox(**base), a


def test_a_load_target_is_a_record_of_named_fields():
    target, a = _target(offsets=[0])
    assert (target.fqn, target.dtype, target.shape, target.offsets, target.flat_start, target.address,
            target.nbytes, target.cuda_device) == ("model.final_ln.weight", "float32", [64], [0], None,
                                                   a.ctypes.data, 256, None)
    with pytest.raises(AttributeError):
        target.nbytes = 1  # frozen: what was checked is what crosses


def test_a_load_target_names_the_entry_and_the_field_it_refuses():
    with pytest.raises(TypeError, match=r"entry 'model\.final_ln\.weight': field 'shape' .*str"):
        _target(shape="64")
    with pytest.raises(TypeError, match=r"entry 'model\.final_ln\.weight': field 'nbytes' is missing"):
        _tessera.LoadTarget(fqn="model.final_ln.weight", dtype="float32", shape=[64], address=1)
    with pytest.raises(TypeError, match=r"entry 'model\.final_ln\.weight': field 'cuda_device' .*float"):
        _target(cuda_device=0.5)
    with pytest.raises(TypeError, match=r"entry 'model\.final_ln\.weight': field 'offsets' .*-1"):
        _target(offsets=[-1])
    with pytest.raises(TypeError, match=r"a LoadTarget's field 'fqn' must be a str, not int"):
        _target(fqn=3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'flat_end'"):
        _target(flat_end=3)


def test_a_held_box_names_the_entry_and_the_field_it_refuses():
    box, a = _held_box()
    assert (box.fqn, box.dtype, box.global_shape, box.offsets, box.lengths, box.address, box.nbytes) == (
        "w", "float32", [4], [0], [4], a.ctypes.data, 16)
    with pytest.raises(TypeError, match=r"entry 'w': field 'lengths' .*must be a list of non-negative ints, not str"):
        _held_box(lengths="4")
    with pytest.raises(TypeError, match=r"entry 'w': field 'lengths' is missing"):
        _held_box(lengths=None)
    with pytest.raises(TypeError, match=r"entry 'w': field 'address' is missing"):
        _tessera.HeldBox(fqn="w", dtype="float32", global_shape=[4], offsets=[0], lengths=[4], nbytes=16)


def test_a_tuple_entry_is_refused_naming_the_parameter():
    a = np.empty(64, np.float32)
    entry = ("model.final_ln.weight", "float32", [64], None, None, a.ctypes.data, a.nbytes, None)
    opened = _tessera.open_checkpoint(str(fixture(C)), [])
    with pytest.raises(TypeError, match=r"argument 'targets'.*LoadTarget"):
        _tessera.load_into(opened, [entry], tessera._typed(_tessera.LoadRequest, timeout_s=10.0))
    with pytest.raises(TypeError, match=r"argument 'targets'.*LoadTarget"):
        _tessera.group_load(opened, [entry], 0, 1, True)


def test_a_tuple_box_is_refused_naming_the_parameter(tmp_path):
    a = np.arange(4, dtype=np.float32)
    box = ("w", "float32", [4], [0], [4], a.ctypes.data, a.nbytes)
    with pytest.raises(TypeError, match=r"argument 'boxes'.*HeldBox"):
        _tessera.save(str(tmp_path / "ckpt"), [box], [], _tessera.SaveRequest())
    assert not (tmp_path / "ckpt").exists()


def test_a_load_and_a_save_of_records_move_the_bytes(tmp_path):
    # The records are what the loads and saves of the package send; here by hand, end to end.
    box, a = _held_box()
    saved = _tessera.save(str(tmp_path / "ckpt"), [box], [], _tessera.SaveRequest())
    assert '"manifest"' in saved
    out = np.full(4, -1.0, np.float32)
    target = _tessera.LoadTarget(fqn="w", dtype="float32", shape=[4], address=out.ctypes.data, nbytes=out.nbytes)
    opened = _tessera.open_checkpoint(str(tmp_path / "ckpt"), [])
    _tessera.load_into(opened, [target], tessera._typed(_tessera.LoadRequest, timeout_s=10.0))
    assert out.tobytes() == a.tobytes()


def test_actions_are_typed_records():
    # The job's actions, as a one-rank group load hands them out; the exchange's are records of
    # the same kind (fields read by name, no tuple positions).
    out = np.empty(64, np.float32)
    target = _tessera.LoadTarget(fqn="model.final_ln.weight", dtype="float32", shape=[64], address=out.ctypes.data,
                                 nbytes=out.nbytes)
    load = _tessera.group_load(_tessera.open_checkpoint(str(fixture(C)), []), [target], 0, 1, True)
    actions = load.job_start()
    assert actions and all(type(action) is _tessera.JobAction for action in actions)
    assert all(isinstance(action.kind, str) and isinstance(action.step, str) for action in actions)
    for cls, fields in [(_tessera.JobAction, {"kind", "key", "keys", "value", "step", "message"}),
                        (_tessera.ExchangeAction, {"op", "kind", "peer", "tag", "nbytes", "address"})]:
        assert not issubclass(cls, tuple)
        assert fields <= {name for name, attr in vars(cls).items() if inspect.isdatadescriptor(attr)}
