"""The compile-pass manager appends to whatever custom pass is configured, runs it first, and
keys Inductor's cache on every sub-pass."""

import types

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from attn_ops.compile_passes.manager import AttnPassManager, install


class Recording(CustomGraphPass):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def __call__(self, graph):
        self.log.append((self.name, sum(1 for n in graph.nodes if n.op == "call_function")))

    def uuid(self):
        return f"recording:{self.name}".encode()


def test_install_keeps_an_existing_pass_and_runs_it_first():
    log = []
    config = types.SimpleNamespace(post_grad_custom_post_pass=Recording("user", log))
    manager = install([Recording("ours", log)], config)
    assert config.post_grad_custom_post_pass is manager
    assert install([Recording("more", log)], config) is manager  # appended, not replaced
    graph = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1).graph
    manager(graph)
    assert [name for name, _ in log] == ["user", "ours", "more"]


def test_uuid_tracks_every_pass_and_is_none_for_a_plain_function():
    a, b = Recording("a", []), Recording("b", [])
    assert AttnPassManager([a, b]).uuid() == AttnPassManager([a, b]).uuid()
    assert AttnPassManager([a, b]).uuid() != AttnPassManager([a]).uuid()
    assert AttnPassManager([a, lambda g: None]).uuid() is None


def test_inductor_runs_the_installed_passes():
    import torch._inductor.config as inductor_config

    log = []
    with inductor_config.patch(post_grad_custom_post_pass=None, fx_graph_cache=False):
        install([Recording("ours", log)])
        torch._dynamo.reset()
        fn = torch.compile(lambda x: torch.relu(x) * 2, fullgraph=True)
        x = torch.randn(8)
        torch.testing.assert_close(fn(x), torch.relu(x) * 2)
    assert log and log[0][0] == "ours" and log[0][1] >= 2
