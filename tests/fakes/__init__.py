"""Test doubles of the external inference engines, named as fakes: ``fake_vllm`` stands in for the ``vllm``
module and ``fake_sglang`` for ``sglang``. Each mirrors the API surface relayrl's adapter uses (names,
signatures, return shapes of the upstream versions recorded in ``docs/engines.md``) and generates for real
with relayrl's HFEngine on a small model. Tests put them into ``sys.modules`` for the test only.
"""
