"""The sandbox a request's own chat template renders in: Jinja's immutable sandbox, bounded.

A request's template is the client's code, run in the process that serves every stream.
Jinja's ImmutableSandboxedEnvironment keeps it from Python's internals and from changing
what it is given; on top of that, what it builds and how long it runs are bounded:
- `*`, `**` and `%`, and the str methods and filters whose result can outgrow their inputs
  (replace, join, indent, wordwrap, tojson, format, center, expandtabs, translate, ...), are
  sized before they run: a value over MAX_PROMPT_CHARS is refused before it is built;
- `+`, `~`, list, tuple and dict literals, every call's and filter's result, and the output
  of macros and {% set %} / {% filter %} blocks are measured (`_weight`) and refused over
  MAX_PROMPT_CHARS, so no loop can grow a value past the bound step by step;
- integer arguments of filters and str methods over MAX_PROMPT_CHARS are refused (sizes such
  as `batch(10**9, x)`), and `range` is bounded by MAX_RANGE;
- a wall-time deadline, MAX_RENDER_S, is checked from a trace function (sys.settrace) on
  the rendering thread, so it also stops loops that call nothing; it cannot stop a single
  C call, which the size bounds keep short;
- the prompt is produced through template.generate() and refused past MAX_PROMPT_CHARS.
The template sees what HF's environment gives one (transformers' chat_template_utils):
trim_blocks and lstrip_blocks, loop controls, the {% generation %} tag, tojson without HTML
escaping, raise_exception, strftime_now, dict and namespace (no "_" attributes).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import re
import sys
import time
from collections.abc import Mapping, Sized
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

# a prompt longer than this exceeds Qwen3's longest context (131,072 tokens) at English text's ~4 characters a token
MAX_PROMPT_CHARS = 1_000_000
# a chat template formats a conversation in milliseconds; one still running is burning the CPU that serves every stream
MAX_RENDER_S = 2.0
# above the count of messages or tools any request body holds; ranges nested in one another meet MAX_RENDER_S
MAX_RANGE = 100_000
# traced line events between two looks at the clock: a look then costs little next to the lines it counts
_CLOCK_EVERY = 1000
# compiled request templates kept, so a client sending one template over and over compiles it once
_COMPILED_KEPT = 16
_MEASURED = (str, bytes, list, tuple, dict, set, frozenset, Namespace)
_NUMBERS = re.compile(r"\d+")


class BoundExceeded(BaseException):
    """A render went over one of the bounds (the message says which). A BaseException, so no
    `except Exception` inside Jinja or the sandbox can swallow it and let the render go on."""


def render_bounded(source: str, context: dict) -> str:
    """`source` compiled in the bounded sandbox and rendered with `context`. Raises
    BoundExceeded for a bound gone over; anything else raised is the template's own failure."""
    with _deadline():
        chunks = _compile(source).generate(context)
        try:
            parts, size = [], 0
            for part in chunks:
                size += len(part)
                if size > MAX_PROMPT_CHARS:
                    raise BoundExceeded(f"the rendered prompt is over the bound of {MAX_PROMPT_CHARS:,} characters "
                                        "(MAX_PROMPT_CHARS)")
                parts.append(part)
        finally:
            chunks.close()
    return "".join(parts)


@contextlib.contextmanager
def _deadline():
    """Within the block, this thread's Python code raises BoundExceeded once MAX_RENDER_S have
    passed: a trace function counts its line events and looks at the clock every _CLOCK_EVERY.
    The thread's previous trace function (a debugger's, coverage's) is back afterwards."""
    end = time.monotonic() + MAX_RENDER_S
    count = 0

    def on_event(frame, event, arg):
        nonlocal count
        count += 1
        if count >= _CLOCK_EVERY:
            count = 0
            if time.monotonic() > end:
                raise BoundExceeded(f"rendering ran past the bound of {MAX_RENDER_S:g} s (MAX_RENDER_S)")
        return on_event

    previous = sys.gettrace()
    sys.settrace(on_event)
    try:
        yield
    finally:
        sys.settrace(previous)


@functools.lru_cache(maxsize=_COMPILED_KEPT)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


@functools.cache
def _environment() -> _BoundedEnvironment:
    return _BoundedEnvironment()


# ---- sizes ----
def _weight(value, indent: int = 0, separators: int = 4) -> int:
    """About how many characters str() or JSON write for `value`: strings' lengths, integers'
    digits, and for each item of a container its `separators` (with `indent`, also its line's
    newline and indentation). Every path through shared items counts, so a value made of one
    list referenced twice, twice over, weighs what printing it writes. Stops past MAX_PROMPT_CHARS."""
    total, stack = 0, [(value, 0)]
    while stack and total <= MAX_PROMPT_CHARS:
        v, depth = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v) + 2
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 1
        elif isinstance(v, Namespace):
            stack.append((object.__getattribute__(v, "_Namespace__attrs"), depth))
        elif isinstance(v, (list, tuple, dict, set, frozenset)):
            total += 2 + len(v) * (separators + (1 + indent * (depth + 1) if indent else 0))
            if total <= MAX_PROMPT_CHARS:
                items = [*v.keys(), *v.values()] if isinstance(v, dict) else v
                stack.extend((x, depth + 1) for x in items)
        else:
            total += 8
    return total


def _check_size(size: int, what: str) -> None:
    if size > MAX_PROMPT_CHARS:
        shown = f"{size:,}" if size < 10**18 else "more than 10^18"
        raise BoundExceeded(f"{what} would make a value of about {shown} characters, over the bound of "
                            f"{MAX_PROMPT_CHARS:,} (MAX_PROMPT_CHARS)")


def _checked(value, what: str):
    if isinstance(value, _MEASURED):
        _check_size(_weight(value), what)
    return value


def _check_ints(what: str, args, kwargs: dict) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_PROMPT_CHARS:
            shown = v if v.bit_length() <= 64 else f"a {v.bit_length()}-bit integer"
            raise BoundExceeded(f"{what}: argument {shown} is over the bound of {MAX_PROMPT_CHARS:,} "
                                "(MAX_PROMPT_CHARS)")


def _format_size(fmt: str, values: list) -> int:
    """At most what formatting `values` into `fmt` ("%" or str.format) writes: fmt, each field a
    copy of the largest value, each width or precision in fmt, and each "*" the largest integer."""
    fields = fmt.count("%") + fmt.count("{")
    widths = sum(int(n) if len(n) < 8 else MAX_PROMPT_CHARS + 1 for n in _NUMBERS.findall(fmt))
    largest = max((_weight(v) for v in values), default=0)
    ints = [abs(v) for v in values if isinstance(v, int)]
    return len(fmt) + fields * largest + widths + fmt.count("*") * max(ints, default=0)


def _format_values(right) -> list:
    """The values `fmt % right` formats."""
    if isinstance(right, Mapping):
        return list(right.values())
    return list(right) if isinstance(right, tuple) else [right]


def _replace_size(s, old, new, count=None) -> int:
    s, old, new = str(s), str(old), str(new)
    n = len(s) + 1 if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(0, len(new) - len(old))


def _join_size(separator, items) -> int:
    return _weight(items) + len(str(separator)) * len(items)


def _lines_size(s, per_line: int) -> int:
    s = str(s)
    return len(s) + (s.count("\n") + 1) * per_line


def _wordwrap_size(s, width, wrapstring) -> int:
    s = str(s)
    breaks = min(len(s), s.count(" ") + s.count("\n") + len(s) // max(width if isinstance(width, int) else 1, 1))
    return len(s) + (breaks + 1) * len(str(wrapstring or "\n"))


def _binop_size(op: str, left, right) -> int:
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(n, int) and isinstance(seq, (str, bytes)):
                return len(seq) * max(n, 0)
            if isinstance(n, int) and isinstance(seq, (list, tuple)):
                return _weight(seq) * max(n, 0)
        if isinstance(left, int) and isinstance(right, int):
            return (abs(left).bit_length() + abs(right).bit_length()) // 3
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        return abs(left).bit_length() * right // 3
    elif op == "%" and isinstance(left, str):
        return _format_size(left, _format_values(right))
    return 0


def _int(value, default: int) -> int:
    return value if isinstance(value, int) else default


# the str methods whose result can outgrow their inputs: (the string, args, kwargs) -> at most its length
_STR_METHOD_SIZES = {
    "replace": lambda s, a, k: _replace_size(s, *a, **k),
    "join": lambda s, a, k: _join_size(s, a[0]),
    "expandtabs": lambda s, a, k: len(s) + s.count("\t") * _int(a[0] if a else k.get("tabsize", 8), 8),
    "translate": lambda s, a, k: len(s) * max([1, *(_weight(v) for v in a[0].values())]),
    "format": lambda s, a, k: _format_size(s, [*a, *k.values()]),
    "format_map": lambda s, a, k: _format_size(s, _format_values(a[0])),
    **dict.fromkeys(("center", "ljust", "rjust", "zfill"), lambda s, a, k: max(len(s), _int(a[0] if a else 0, 0))),
}
# the filters whose result can outgrow their inputs: their bound arguments -> at most the result's length
_FILTER_SIZES = {
    "replace": lambda a: _replace_size(a["s"], a["old"], a["new"], a["count"]),
    "join": lambda a: _join_size(a["d"], a["value"]),
    "indent": lambda a: _lines_size(a["s"], a["width"] if isinstance(a["width"], int) else len(str(a["width"]))),
    "wordwrap": lambda a: _wordwrap_size(a["s"], a["width"], a["wrapstring"]),
    "tojson": lambda a: _weight(a["x"], _int(a["indent"], 0), sum(len(str(s)) for s in a["separators"] or ", ")),
    "format": lambda a: _format_size(str(a["value"]), [*a["args"], *a["kwargs"].values()]),
    "center": lambda a: max(len(str(a["value"])), _int(a["width"], 0)),
}


def _predicted(size_of, *args) -> int:
    """size_of(*args), or 0 when the arguments are not what the call takes (it then fails itself)."""
    try:
        return size_of(*args)
    except (TypeError, ValueError, LookupError, AttributeError):
        return 0


def _bounded_filter(name: str, func):
    """func, a filter, with its integer arguments bounded, its result sized before it runs
    when it can outgrow its input (_FILTER_SIZES), and measured after."""
    size_of = _FILTER_SIZES.get(name)
    signature = inspect.signature(func) if size_of is not None else None
    skip = 2 if getattr(func, "jinja_pass_arg", None) is not None else 1  # the context or environment, the value
    what = f"the {name} filter"

    @functools.wraps(func)
    def bounded(*args, **kwargs):
        _check_ints(what, args[skip:], kwargs)
        if signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                bound = None  # the filter itself says what is wrong
            if bound is not None:
                bound.apply_defaults()
                if name == "join" and not isinstance(bound.arguments["value"], Sized):
                    bound.arguments["value"] = list(bound.arguments["value"])  # a generator: sized once
                    args, kwargs = bound.args, bound.kwargs
                _check_size(_predicted(size_of, bound.arguments), what)
        return _checked(func(*args, **kwargs), what)

    return bounded


# ---- what the template sees ----
def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _strftime_now(format):
    return datetime.now().strftime(format)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _bounded_range(*args) -> range:
    r = range(*args)
    try:
        n = len(r)
    except OverflowError:
        n = MAX_RANGE + 1
    if n > MAX_RANGE:
        raise BoundExceeded(f"a range of {n if n <= MAX_RANGE + 1 else 'more'} items is over the bound of "
                            f"{MAX_RANGE:,} (MAX_RANGE)")
    return r


class _TemplateDict:
    """The `dict` global as HF gives it: dict(...) and dict.fromkeys, nothing of the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _check_attribute_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a namespace may not hold attributes that start with '_', got {name!r}")


class _TemplateNamespace(Namespace):
    """The `namespace` global as HF gives it: no attribute starting with "_" (they lead to CPython's internals)."""

    def __init__(*args, **kwargs):  # Namespace's own signature, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_attribute_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_attribute_name(name)
        Namespace.__setitem__(self, name, value)


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}, which HF's templates use to mark the assistant's
    text (for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's compiler, with `~` and list, tuple and dict literals built through the
    environment's measures (the sandbox intercepts operators and calls, not these)."""

    def visit_Concat(self, node, frame):
        self.write("environment.join_checked((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_List(self, node, frame):
        self._checked(super().visit_List, node, frame)

    def visit_Dict(self, node, frame):
        self._checked(super().visit_Dict, node, frame)

    def visit_Tuple(self, node, frame):
        if node.ctx != "load":  # a target ({% for a, b in ... %}) is assigned to, not built
            return super().visit_Tuple(node, frame)
        self._checked(super().visit_Tuple, node, frame)

    def _checked(self, visit, node, frame):
        self.write("environment.checked_literal(")
        visit(node, frame)
        self.write(")")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with HF's settings and globals, bounded as the module says."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        del self.globals["lipsum"]  # Jinja's lorem ipsum: n paragraphs of text from one small argument
        self.globals.update(range=_bounded_range, raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), namespace=_TemplateNamespace)

    def call_binop(self, context, operator, left, right):
        what = f"the {operator!r} operator"
        _check_size(_binop_size(operator, left, right), what)
        return _checked(super().call_binop(context, operator, left, right), what)

    def call(self, context, obj, /, *args, **kwargs):
        method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            name = getattr(method, "__name__", "")
            what = f"str.{name}"
            if name == "join" and args and not isinstance(args[0], Sized):
                args = (list(args[0]), *args[1:])  # a generator: sized once
            _check_ints(what, args, kwargs)
            if name in _STR_METHOD_SIZES:
                _check_size(_predicted(_STR_METHOD_SIZES[name], owner, args, kwargs), what)
        return _checked(super().call(context, obj, *args, **kwargs), f"calling {getattr(obj, '__name__', obj)!r}")

    def concat(self, parts):
        """The output of a macro, a call block, {% set %} or {% filter %} block, joined."""
        parts = list(parts)
        _check_size(sum(len(p) for p in parts), "a block's output")
        return "".join(parts)

    def join_checked(self, values) -> str:
        """The `~` operator: values as strings, joined."""
        parts = [str(v) for v in values]
        _check_size(sum(len(p) for p in parts), "the '~' operator")
        return "".join(parts)

    def checked_literal(self, value):
        return _checked(value, "a list, tuple or dict literal")
