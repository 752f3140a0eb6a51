"""`--plugin MODULE:OBJECT` (lab/plugins.py): a protocol of one's own, bound into every rank with no file of the lab
edited. The worked example (examples/relay_in_header.py) takes the lab's own decisions at every step with no relay
send, which `compare --against lab` accepts as the one difference it names; the breaking example
(examples/breaks_agreement.py) is caught. A plug-in that cannot be one is refused before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_lab.errors import ConfigError
from hicache_lab.lab.binders import LAB
from hicache_lab.lab.check.compare import compare
from hicache_lab.lab.plugins import load_plugin
from hicache_lab.lab.presets import WORLD, config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon_here", "write MODULE:OBJECT"),
        ("no_such_module_anywhere:PLUGIN", "cannot import 'no_such_module_anywhere'"),
        (f"{EXAMPLES / 'relay_in_header.py'}:RelayInHeader", "is type, not a Binder instance"),
    ],
)
def test_what_is_not_a_plugin_is_refused_saying_what_to_change(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_plugin(spec)


@pytest.mark.spawns
def test_the_worked_example_agrees_as_the_lab_does_and_the_breaking_one_is_caught(tmp_path):
    base = config(WORLD, "--pp 2")
    relay = compare(
        base.with_lab(plugins=(f"{EXAMPLES / 'relay_in_header.py'}:PLUGIN",)), tmp_path / "a", LAB, against="lab"
    )
    assert relay.sound and relay.equal, [str(d) for d in relay.differences[:3]]
    assert {d.quantity for d in relay.named} == {"relay_sent"}  # no relay send, every other decision the lab's
    assert relay.summaries["lab"]["scheduling"]["max_relay_sends"] == 0
    broken = compare(
        base.with_lab(plugins=(f"{EXAMPLES / 'breaks_agreement.py'}:PLUGIN",)), tmp_path / "b", LAB, against="lab"
    )
    assert broken.summaries["lab"]["first_divergence"]["quantity"] == "acks_write" and broken.differences
    assert str(broken.differences[0]).endswith(f"without plug-ins {broken.differences[0].sglang}")
