"""The command line of every entry point (train.py, star.py, evaluate.py): a typed config
dataclass from
  1. its defaults (each written once, in the dataclass), then
  2. --config FILE.toml (keys are field names), then
  3. --key=value, --key value, or a bare --flag for true,
each value coerced to its field's type (an int for a float is fine; a dict is a TOML table in a
file, a JSON object on the command line). An unknown key (the closest one suggested), a wrong type
or a value outside the field's CHOICES stops with an error naming the key and its source; a TOML
syntax error names file:line:column. --help (-h): each key's type, default and comment, by group.
banner(): a run's config, aligned. A user's mistake raises UserError.

  python train.py --config configs/smoke.toml --rl_steps=8 --beta 0.04 --resume
"""
import contextlib
import dataclasses
import difflib
import inspect
import json
import os
import re
import sys
import textwrap
import tomllib


class UserError(ValueError):
    """A mistake the user fixes (a setting, path, data line, checkpoint), named in its message; not
    a bug."""


def parse_config(cls, argv: list[str]):
    """cls (a dataclass with a CHOICES dict) from its defaults, a --config file and argv's
    --key=value (see the top)."""
    names, values, args, kw = {f.name for f in dataclasses.fields(cls)}, {}, list(argv), {}
    # a string as the field's type (a dict's: a JSON object)
    parse = {bool: lambda s: {"true": True, "1": True, "yes": True,
                              "false": False, "0": False, "no": False}[s.lower()],
             int: int, float: float, dict: json.loads}
    if "--help" in args or "-h" in args:
        print(help_text(cls))
        raise SystemExit(0)
    while args:
        arg = args.pop(0)
        if arg == "--config":
            if not os.path.isfile(path := args.pop(0) if args else ""):
                raise SystemExit(f"error: --config needs an existing TOML file, got {path!r}")
            values.update((k, (v, path)) for k, v in run_main(load_toml, path).items())
        elif arg.startswith("--"):
            key, eq, val = arg[2:].partition("=")
            val = val if eq else args.pop(0) if args and not args[0].startswith("--") else "true"
            values[key.replace("-", "_")] = (val, "command line")
        else:
            raise SystemExit(f"error: unexpected argument {arg!r}; use --key=value")
    for key, (val, where) in values.items():
        if key not in names:
            near = "".join(f"; did you mean {k!r}?"
                           for k in difflib.get_close_matches(key, names, n=1))
            raise SystemExit(f"error: unknown config key {key!r} ({where}){near}")
        typ, err, raw = type(default(cls, key)), f"error: config key {key!r} ({where})", None
        # a string that does not parse stays raw: the check below says so
        if isinstance(val, str) and typ in parse:
            with contextlib.suppress(ValueError, KeyError):
                val = parse[typ](raw := val)
        kw[key] = val = float(val) if typ is float and type(val) is int else val
        if type(val) is not typ:  # a dict's string that is not JSON (still raw) gets the how-to
            how = f"table: a JSON object on the command line, e.g. --{key}='{{\"name\": {{}}}}'"
            raise SystemExit(f"{err} needs a "
                             f"{how if typ is dict and val is raw else typ.__name__}, got {val!r}")
        if val not in cls.CHOICES.get(key, (val,)):
            raise SystemExit(f"{err} is {val!r}; choose one of {tuple(cls.CHOICES[key])}")
    return cls(**kw)


def load_toml(path: str) -> dict:
    """A --config file's table; a syntax error in it is a UserError naming path:line:column."""
    with open(path, "rb") as f:
        text = f.read().decode()
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # its message ends "(at line L, column C)" or "(at end of document)"
        lines, m = text.split("\n"), re.fullmatch(
            r"(.*) \(at (?:line (\d+), column (\d+)|end of document)\)", str(e))
        raise UserError(f"{path}:{m[2] or len(lines)}:"
                        f"{m[3] or len(lines[-1]) + 1}: {m[1]}") from None


def default(cls, name: str):
    """A field's default, made by its default_factory (a dict field's) if it has one."""
    return (f.default_factory()
            if (f := cls.__dataclass_fields__[name]).default is dataclasses.MISSING else f.default)


def toml_value(v) -> str:
    """v as TOML: a dict as an inline table, anything else as JSON (TOML's strings, numbers,
    booleans, arrays)."""
    if isinstance(v, dict):
        keys = [k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k, ensure_ascii=False)
                for k in v]
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in zip(keys, v.values())) + "}"
    return json.dumps(v, ensure_ascii=False)


def run_main(main, *args):
    """main(*args), where a UserError prints `error: message` (every rank: any one may hit it) and
    exits 1."""
    try:
        return main(*args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def field_docs(cls) -> dict[str, list[str]]:
    """{field: [its `# --- group` or class name, its comment and the comment lines under it]} in
    cls's source."""
    docs = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        group, last = klass.__name__, None
        for line in inspect.getsource(klass).splitlines():
            if m := re.match(r"\s+# --- (.*)", line):
                group, last = m[1], None
            elif m := re.match(r"\s+(\w+): \S.*? = .*?(?:\s#\s*(.*))?$", line):
                # (a default holds no " #")
                last = docs.setdefault(m[1], [group, m[2] or ""])  # a base's group and comment stay
            elif last and (m := re.match(r"\s+#\s*(.*)", line)):
                last[1] += " " + m[1]
            else:  # only the comment lines right under a field continue its comment
                last = None
    return docs


def help_text(cls) -> str:
    """--help: the entry point's docstring head and commands, each field under its group with type,
    default, comment."""
    # the script whose config cls is (train.py, even for a Config it imports)
    main = sys.modules["__main__"]
    mod = main if any(v is cls for v in vars(main).values()) else inspect.getmodule(cls)
    paras = (mod.__doc__ or "").strip("\n").split("\n\n")
    out = [paras[0], "",
           f"usage: python {os.path.basename(mod.__file__)} [--config FILE.toml] "
           "[--key=value | --key value | --flag]...\n"
           "  (a default below gives way to the file's value, and that to the command line's)"]
    out += ["", paras[-1]] if re.match(r"\s*(python|torchrun) ", paras[-1]) else []
    width, group, docs = max(len(f.name) for f in dataclasses.fields(cls)), None, field_docs(cls)
    for f in dataclasses.fields(cls):
        name, note = docs.get(f.name, [cls.__name__, ""])
        out += ["", f"# --- {(group := name)}"] if name != group else []
        row = (f"  --{f.name:{width}}  {type(default(cls, f.name)).__name__:5}  "
               f"{toml_value(default(cls, f.name)):12}  ")
        out.append(textwrap.fill(note, 120, initial_indent=row,
                                 subsequent_indent=" " * (width + 27),
                                 break_on_hyphens=False) or row.rstrip())
    return "\n".join(out)


def config_lines(cfg, every: bool = False) -> list[str]:
    """cfg as aligned TOML `key = value` lines by group (they paste into a --config file):
    off-default fields or all."""
    group, groups = {k: g for k, (g, _) in field_docs(type(cfg)).items()}, {}
    for f in dataclasses.fields(cfg):
        # defaults as __post_init__ leaves them
        if every or getattr(cfg, f.name) != getattr(type(cfg)(), f.name):
            groups.setdefault(group.get(f.name, type(cfg).__name__), []).append(f.name)
    width = max((len(k) for ks in groups.values() for k in ks), default=0)
    return [line for name, ks in groups.items() for line in
            [f"  # --- {name}"] + [f"  {k:{width}s} = {toml_value(getattr(cfg, k))}" for k in ks]]


def banner(cfg, objective: str, model, proc) -> str:
    """The start of a run: its config (config_lines), the objective, the model's size and dtypes,
    world and device."""
    every, dtype = (cfg.print_config == "all",
                    str(next(model.parameters()).dtype).removeprefix("torch."))
    head = "config:" if every else ("config (the fields off their defaults; "
                                    "--print_config=all for every field):")
    size = f"{sum(q.numel() for q in model.parameters()):,} parameters, {dtype} weights"
    return "\n".join([head] + config_lines(cfg, every) + [
        f"objective: {objective}",
        f"model: {size}" + (", bf16 compute" if proc.device.type == "cuda" else "")
        + f" | world size {proc.world} | device {proc.device}"])
