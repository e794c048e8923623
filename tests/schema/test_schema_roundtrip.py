"""Property-based round trips: Manifest -> bytes -> Manifest, and whole bundles on disk."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepbundle.schema import (
    STATE_INPUT_KINDS,
    BatchInput,
    ConstantInput,
    DType,
    Entry,
    Hyperparameter,
    HyperparameterInput,
    InputKind,
    Manifest,
    MetricOutput,
    NamedSpec,
    Producer,
    Program,
    Rng,
    RngSeedInput,
    Section,
    SectionKind,
    SectionPayload,
    StateEntry,
    StateInput,
    StateKind,
    StateUpdateOutput,
    TensorSpec,
    decode_manifest,
    encode_manifest,
    open_bundle,
    write_bundle,
)

# -- any well-typed manifest (cross-field rules ignored) ----------------------------------

texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
ints = st.integers(-(2**63), 2**64 - 1)
small_tuples = lambda s: st.lists(s, max_size=3).map(tuple)  # noqa: E731

specs = st.builds(TensorSpec, st.sampled_from(DType), small_tuples(ints))
named_specs = st.builds(NamedSpec, texts, specs)
inputs = st.one_of(
    st.builds(StateInput, st.sampled_from(sorted(STATE_INPUT_KINDS)), texts, specs),
    st.builds(BatchInput, texts, specs),
    st.builds(RngSeedInput, specs),
    st.builds(HyperparameterInput, texts, specs),
    st.builds(ConstantInput, texts, specs, texts),
)
outputs = st.one_of(
    st.builds(MetricOutput, texts, specs),
    st.builds(StateUpdateOutput, texts, specs, st.none() | ints),
)
programs = st.builds(
    Program,
    section=texts,
    stablehlo_version=texts,
    inputs=small_tuples(inputs),
    outputs=small_tuples(outputs),
    batch=small_tuples(named_specs),
    platforms=small_tuples(texts),
    text_section=st.none() | texts,
)
manifests = st.builds(
    Manifest,
    producer=st.builds(Producer, texts, texts, texts, texts),
    entries=st.dictionaries(
        texts, st.builds(Entry, small_tuples(programs), st.booleans()), max_size=3
    ),
    state=small_tuples(
        st.builds(
            StateEntry,
            texts,
            st.sampled_from(StateKind),
            specs,
            texts,
            st.booleans(),
            small_tuples(texts),
        )
    ),
    hyperparameters=small_tuples(
        st.builds(Hyperparameter, texts, specs, st.floats(allow_nan=False))
    ),
    rng=st.none() | st.builds(Rng, st.integers(0, 2**64 - 1)),
    sections=small_tuples(
        st.builds(Section, texts, st.sampled_from(SectionKind), ints, ints, texts)
    ),
    required_features=small_tuples(texts),
)


@settings(max_examples=200, deadline=None)
@given(manifests)
def test_encode_decode_round_trip(manifest: Manifest) -> None:
    data = encode_manifest(manifest)
    decoded = decode_manifest(data)
    assert decoded == manifest
    assert encode_manifest(decoded) == data  # deterministic, and canonical


# -- valid bundles ----------------------------------------------------------------------------

small_specs = st.builds(
    TensorSpec, st.sampled_from(DType), st.lists(st.integers(0, 3), max_size=3).map(tuple)
)


@st.composite
def bundles(draw: st.DrawFn) -> tuple[Manifest, list[SectionPayload]]:
    """A valid manifest and its payloads, in a random section order."""
    payloads: list[SectionPayload] = []
    state: list[StateEntry] = []
    for i in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(StateKind))
        s = draw(small_specs)
        name = f"layer{i}.{draw(st.sampled_from(['weight', 'bias', 'running_mean']))}"
        aliases = (f"tied{i}",) if draw(st.booleans()) else ()
        trainable = kind is StateKind.PARAMETER and draw(st.booleans())
        state.append(StateEntry(name, kind, s, f"state.{i}", trainable, aliases))
        payloads.append(
            SectionPayload(
                f"state.{i}",
                SectionKind.TENSOR,
                draw(st.binary(min_size=s.nbytes, max_size=s.nbytes)),
            )
        )
    hypers = tuple(
        Hyperparameter(f"h{i}", TensorSpec(draw(st.sampled_from([DType.F32, DType.F64])), ()), v)
        for i, v in enumerate(draw(st.lists(st.floats(-1e3, 1e3), max_size=2)))
    )
    rng = draw(st.none() | st.builds(Rng, st.integers(0, 2**64 - 1)))
    batch = tuple(
        NamedSpec(f"b{i}", s) for i, s in enumerate(draw(st.lists(small_specs, max_size=2)))
    )

    entries: dict[str, Entry] = {}
    for e, entry_name in enumerate(
        draw(
            st.lists(
                st.sampled_from(["train", "eval", "predict"]), min_size=1, max_size=2, unique=True
            )
        )
    ):
        updates = entry_name == "train"
        bound = draw(st.permutations(state))
        bound = bound[: draw(st.integers(0, len(bound)))]
        ins: list[Any] = [StateInput(InputKind(s.kind.value), s.name, s.spec) for s in bound]
        ins += [BatchInput(b.name, b.spec) for b in batch if draw(st.booleans())]
        if rng is not None and draw(st.booleans()):
            ins.append(RngSeedInput(TensorSpec(DType.I64, ())))
        ins += [HyperparameterInput(h.name, h.spec) for h in hypers if draw(st.booleans())]
        if draw(st.booleans()):
            cspec = draw(small_specs)
            cname = f"const.{e}"
            ins.append(ConstantInput("constant.0", cspec, cname))
            payloads.append(
                SectionPayload(
                    cname,
                    SectionKind.TENSOR,
                    draw(st.binary(min_size=cspec.nbytes, max_size=cspec.nbytes)),
                )
            )
        ins = draw(st.permutations(ins))
        outs: list[Any] = [MetricOutput("loss", TensorSpec(DType.F32, ()))]
        if updates:
            for idx, b in enumerate(ins):
                if isinstance(b, StateInput) and draw(st.booleans()):
                    outs.append(
                        StateUpdateOutput(b.name, b.spec, draw(st.sampled_from([idx, None])))
                    )
        outs = draw(st.permutations(outs))
        text = f"{entry_name}.mlir" if draw(st.booleans()) else None
        payloads.append(
            SectionPayload(
                f"{entry_name}.program", SectionKind.PROGRAM, draw(st.binary(max_size=200))
            )
        )
        if text is not None:
            payloads.append(
                SectionPayload(text, SectionKind.TEXT, draw(st.text(max_size=100)).encode())
            )
        program = Program(
            section=f"{entry_name}.program",
            stablehlo_version="1.8.0",
            inputs=tuple(ins),
            outputs=tuple(outs),
            batch=batch,
            platforms=tuple(draw(st.lists(st.sampled_from(["cpu", "cuda", "tpu"]), unique=True))),
            text_section=text,
        )
        entries[entry_name] = Entry((program,), updates)

    manifest = Manifest(
        producer=Producer("0.1.0", "2.9.0", "2.9.0", "0.7.1"),
        entries=entries,
        state=tuple(state),
        hyperparameters=hypers,
        rng=rng,
        sections=(),
    )
    return manifest, draw(st.permutations(payloads))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bundles())
def test_write_open_round_trip(case: tuple[Manifest, list[SectionPayload]]) -> None:
    manifest, payloads = case
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "bundle.sbnd"
        final = write_bundle(path, manifest, payloads)
        assert final.sections[0].offset == 0 if final.sections else True
        with open_bundle(path) as bundle:
            assert bundle.manifest == final
            assert bundle.verify() == []
            for payload in payloads:
                assert bytes(bundle.section(payload.name)) == bytes(payload.data)
        # The same inputs give the same file.
        again = Path(directory) / "again.sbnd"
        write_bundle(again, manifest, payloads)
        assert again.read_bytes() == path.read_bytes()
