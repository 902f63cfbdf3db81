"""The normal paths' kernels get every argument under the name its binding gives it
(csrc/intranode/binding.cpp, csrc/internode/binding.cpp), so an argument added, removed or
reordered on one side cannot silently land in another's place. internode.py passes them by
keyword; intranode.py's one-crossing entries (dispatch_first_call, notify_call, dispatch_call,
combine_call) pass them by position, each argument an expression whose last name is its
parameter's (`region.runtime`, `call.sig`, `plan.num_experts`, a local `hook`): pybind11 matches keywords
by name at every call, about 0.25 µs each, 5 µs of a cached dispatch's host time. Read from the
sources (no GPU, no build needed). The low-latency kernels are called by position too."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def binding_arguments(path: str = "intranode") -> dict:
    """name -> (argument names in order, names with a default), from the pybind11 definitions."""
    src = (ROOT / "csrc" / path / "binding.cpp").read_text()
    pattern = r'intra\.def\("(\w+)", &mep::\w+, (.*?)\);' if path == "intranode" else r'\.def\("(\w+)", &\w+::\w+, (py::arg.*?)\)\n'
    found = re.findall(pattern, src, re.S)
    if path == "intranode":  # the handle's state, bound once per routing
        found += re.findall(r'py::class_<mep::(HandleState)>.*?py::init\(&mep::handle_state\), (.*?)\);', src, re.S)
    out = {}
    for name, body in found:
        args = re.findall(r'py::arg\("(\w+)"\)( = [^,)]+)?', body)
        out[name] = ([a for a, _ in args], {a for a, d in args if d})
    return out


def _last_name(node) -> str:
    """The name an argument expression ends in (`a.b.c` -> "c", `x` -> "x"); "" for anything else."""
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def kernel_calls(path: str = "intranode", holder: str = "kernels", module: str = "") -> list:
    """(kernel name, argument names, positional count, line) of every kernel call in a path's module
    (an argument's name: its keyword, or for a positional one the last name of its expression)
    (or in `module`, a file under megatron_ep/), direct (`self.HOLDER.NAME(...)`), through
    `call.sends(self.HOLDER.NAME, ...)`, or through a local name bound to `....HOLDER.NAME`."""
    source = ROOT / "megatron_ep" / (module or f"backends/cuda/paths/{path}.py")
    tree = ast.parse(source.read_text())
    def bound(value):  # `....HOLDER.NAME`, or `....HOLDER.NAME if ... else other` (an entry or its stand-in)
        value = value.body if isinstance(value, ast.IfExp) else value
        return value.attr if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Attribute) \
            and value.value.attr == holder else None

    aliases = {t.id: bound(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
               for t in node.targets if isinstance(t, ast.Name) and bound(node.value)}

    def kernel(node):
        if isinstance(node, ast.Attribute) and _last_name(node.value) == holder:
            return node.attr
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        return None

    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, args = kernel(node.func), node.args
        if name is None and isinstance(node.func, ast.Attribute) and node.func.attr == "sends" and node.args:
            name, args = kernel(node.args[0]), node.args[1:]
        if name is not None:
            calls.append((name, [_last_name(a) for a in args] + [k.arg for k in node.keywords], len(args), node.lineno))
    return calls


def test_every_intranode_kernel_call_names_all_its_arguments():
    bound = binding_arguments()
    assert set(bound) >= {"notify_call", "dispatch_call", "combine_call"}, sorted(bound)
    calls = kernel_calls()
    assert {c[0] for c in calls} == set(bound), f"kernels bound but never called, or called but not bound: {calls}"
    for name, given, positional, line in calls:
        names, defaults = bound[name]
        # by position, in the binding's order, each argument's last name its parameter's
        assert positional == len(given), f"intranode.py:{line}: {name} gets keywords {given[positional:]}"
        assert given == names[:positional], f"intranode.py:{line}: {name}: arguments named {given}, parameters {names}"
        missing = [a for a in names[positional:] if a not in defaults]
        assert not missing, f"intranode.py:{line}: {name}: missing {missing}"


def test_the_positional_rule_catches_a_swapped_argument():
    """kernel_calls reads a positional argument's name from its expression, so two swapped
    arguments, or one not named as its parameter, fail the test above."""
    import textwrap

    src = textwrap.dedent("""
        def f(self, call, region, plan):
            call.sends(self.kernels.combine_call, region.runtime, plan.sig, state)
    """)
    node = ast.parse(src).body[0].body[0].value
    assert [_last_name(a) for a in node.args[1:]] == ["runtime", "sig", "state"]
    names = binding_arguments()["combine_call"][0]
    assert ["runtime", "sig", "state"] != names[:3] == ["runtime", "state", "sig"]


def test_the_notify_trace_names_all_notify_call_arguments():
    """megatron_ep/tools/tracing.py's notify-only run calls the intranode entry outside the path."""
    names, defaults = binding_arguments()["notify_call"]
    calls = kernel_calls(module="tools/tracing.py")
    assert [c[0] for c in calls] == ["notify_call"], calls
    for _, keywords, positional, line in calls:
        missing = [a for a in names if a not in keywords and a not in defaults]
        unknown = [k for k in keywords if k not in names]
        assert positional == 0 and not missing and not unknown, \
            f"tracing.py:{line}: notify_call: {positional} positional, unknown {unknown}, missing {missing}"


# the internode entries that compose an intranode one (csrc/intranode/composed.h): its arguments
# first, in its order, passed through as `*intranode`; then the internode kernel's, by keyword
COMPOSED = {"dispatch_first_call": "dispatch_first_call", "dispatch_cached_call": "dispatch_call",
            "combine_call": "combine_call"}


def test_every_internode_kernel_call_names_all_its_arguments():
    bound = binding_arguments("internode")
    kernels = {"dispatch_send", "dispatch_recv"} | set(COMPOSED)
    assert kernels <= set(bound), sorted(bound)
    calls = [c for c in kernel_calls("internode", "buf") if c[0] in kernels]
    assert {c[0] for c in calls} == kernels, calls
    intra = binding_arguments()
    for name, keywords, positional, line in calls:
        names, defaults = bound[name]
        if name in COMPOSED:  # the intranode stage's arguments come through as one starred positional
            names = names[len(intra[COMPOSED[name]][0]):]
            assert keywords[:1] == [""] and positional == 1, f"internode.py:{line}: {name}: expected (*intranode, ...)"
            keywords, positional = keywords[1:], 0
        unknown = [k for k in keywords if k not in names]
        missing = [a for a in names if a not in keywords and a not in defaults]
        assert positional == 0 and not unknown and not missing, \
            f"internode.py:{line}: {name}: {positional} positional, unknown {unknown}, missing {missing}"


def test_a_composed_entry_takes_its_intranode_entry_s_arguments_first():
    """intranode.py crosses into the internode path's entry in place of its own with the same
    arguments, by position: the composed entry's first parameters are the intranode entry's, by
    name and in order, and its own come after with names of their own."""
    inter, intra = binding_arguments("internode"), binding_arguments()
    for composed, entry in COMPOSED.items():
        names, own = inter[composed][0], intra[entry][0]
        assert names[:len(own)] == own, (composed, names, own)
        assert not set(names[len(own):]) & set(own), composed


def test_one_name_for_the_expert_alignment_from_request_to_kernel():
    """Buffer.dispatch(expert_alignment=) -> DispatchRequest.expert_alignment -> notify_call's
    expert_alignment: the same name at every step."""
    from megatron_ep.core.requests import DispatchRequest

    assert "expert_alignment" in DispatchRequest.__dataclass_fields__
    assert "expert_alignment" in binding_arguments()["notify_call"][0]
    src = (ROOT / "megatron_ep" / "backends" / "cuda" / "paths" / "intranode.py").read_text()
    assert not re.search(r"\balignment\b", src), "intranode.py names the expert alignment otherwise"
