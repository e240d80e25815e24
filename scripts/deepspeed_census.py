r"""Census of how real code uses DeepSpeed, found statically (``ast``): imports, API calls,
engine/optimizer/parameter attributes and config keys, each with file and line.

Regenerate under DeepSpeed's virtualenv (DeepSpeed is imported only to list class members and
config keys; nothing scanned is imported)::

    for r in huggingface/accelerate deepspeedai/DeepSpeed deepspeedai/DeepSpeedExamples \
             OpenRLHF/OpenRLHF hiyouga/LLaMA-Factory axolotl-ai-cloud/axolotl; do
        git clone --bare https://github.com/$r REPOS/${r/\//+}; done
    DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_census.py --repos REPOS \
        --write scripts/census/deepspeed_census.json

Rows: ``import`` (the dotted name imported); ``call``/``name`` (an attribute chain on a name bound
to DeepSpeed, as ``deepspeed.*``); ``attribute`` (a ``ds_*`` name DeepSpeed itself uses, a
DeepSpeed-only member of CLASSES, or any attribute of a variable assigned from
``deepspeed.initialize``) as ``Class.member`` when one class fits, else with ``candidates``;
``config_key`` (a DeepSpeed config key, as its path). Attributes and keys are looked for only in
files that mention DeepSpeed, by heuristics (GENERIC); the JSON records the names they match.
"""

import argparse
import ast
import contextlib
import importlib
import importlib.metadata
import inspect
import io
import json
import pathlib
import re
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import typing
from collections import Counter, defaultdict

COMMAND = (
    "DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_census.py --repos REPOS"
    " --write scripts/census/deepspeed_census.json  (REPOS: see the script's docstring)"
)
IMPORTS_DS = re.compile(r"^\s*(import|from)\s+deepspeed\b", re.M)
# label, where from, what: for pip, the files always read ("*": all; any file that imports
# deepspeed is read too); for github, the folders read at HEAD (.py, and .md/.rst python blocks)
SOURCES = """
trl                  pip:trl                               *
accelerate           pip:accelerate                        *
transformers         pip:transformers                      trainer.py training_args.py
lightning            pip:lightning                         -
accelerate-examples  github:huggingface/accelerate         examples
DeepSpeed-tutorials  github:deepspeedai/DeepSpeed          docs/_tutorials
DeepSpeedExamples    github:deepspeedai/DeepSpeedExamples  training applications/DeepSpeed-Chat
OpenRLHF             github:OpenRLHF/OpenRLHF              openrlhf examples
LLaMA-Factory        github:hiyouga/LLaMA-Factory          src
axolotl              github:axolotl-ai-cloud/axolotl       src
"""
RT = "deepspeed.runtime."
CLASSES = {  # class: module, and the words of a receiver name that point to it
    "DeepSpeedEngine": (RT + "engine", ("engine", "model_wrapped")),
    "DeepSpeedZeroOptimizer_Stage3": (RT + "zero.stage3", ("optim",)),
    "DeepSpeedZeroOptimizer": (RT + "zero.stage_1_and_2", ("optim",)),
    "DeepSpeedZeRoOffload": (RT + "zero.parameter_offload", ("offload",)),
    "PartitionedParameterCoordinator": (
        RT + "zero.partitioned_param_coordinator",
        ("coordinator",),
    ),
}
MODELS = {  # pydantic sub-configs by the block that holds them ("": the top level)
    "zero_optimization": RT + "zero.config:DeepSpeedZeroConfig",
    "fp16": RT + "precision_config:DeepSpeedFP16Config",
    "bf16": RT + "precision_config:DeepSpeedBF16Config",
    "tensor_parallel": RT + "tensor_parallel.config:TPTrainingConfig",
    "": "deepspeed.monitor.config:DeepSpeedMonitorConfig",
    "comms_logger": "deepspeed.comm.config:CommsLoggerConfig",
    "compile": "deepspeed.compile.config:CompileConfig",
}
# Names too common in ML code to count without context. Such a member needs a receiver assigned
# from deepspeed.initialize or one named after its class; such a key needs a DeepSpeed parent
# key, DeepSpeed sibling keys or a receiver matching DS_RECEIVER. Members named like a config
# key, and keys without "_", are generic too; a nested key always needs that context.
GENERIC = set(
    """
_save_checkpoint activation_checkpointing backward check_overflow clip_grad collate_fn compile
config dataloader_drop_last destroy device dtype flatten get_lr global_rank
gradient_accumulation_steps is_gradient_accumulation_boundary load_checkpoint local_rank log_level
loss_scale losses lr_scheduler module monitor mpu no_sync num_experts optimizer overflow
param_names save_checkpoint scale state timers train_batch_size unflatten use_muon world_size
""".split()
)
DS_RECEIVER = re.compile(r"(?<![a-z])ds(?![a-z])|deepspeed|zero", re.I)
SETTINGS = re.compile(r"config|cfg|args", re.I)  # a receiver so named holds settings, not members


def introspect() -> dict:
    """DeepSpeed-only members of CLASSES, the ds_* names DeepSpeed uses, its config key paths."""
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout
        import deepspeed
        import torch
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime.config_utils import DeepSpeedConfigModel

        module, optimizer = torch.nn.Module(), torch.optim.Optimizer([torch.zeros(1)], {})
        torch_members = {*dir(module), *dir(optimizer)}  # instance attributes included
        members = {}
        for name, (module, _) in CLASSES.items():
            cls = getattr(importlib.import_module(module), name)
            found = {*dir(cls), *_self_attributes(cls)} - torch_members
            members[name] = sorted(m for m in found if "__" not in m)
        engines = [deepspeed.DeepSpeedEngine, deepspeed.PipelineEngine]
        engine_members = {m for c in engines for m in {*dir(c), *_self_attributes(c)}}
        engine_members.add("module")  # set as self.__dict__['module'] (engine.py, its 2072)
        from deepspeed.runtime import config as ds_config

        removed = [*ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS]
        removed += [f"zero_optimization.{k}" for k in ds_config._REMOVED_ZERO_CONFIG_KEYS]
        keys = dict.fromkeys(sorted(_probe(DeepSpeedConfig)), "DeepSpeedConfig reads it")
        for block, spec in MODELS.items():
            module, name = spec.split(":")
            model = getattr(importlib.import_module(module), name)
            for k in _model_keys(model, DeepSpeedConfigModel):
                keys.setdefault(f"{block}.{k}".lstrip("."), name)
        package = pathlib.Path(deepspeed.__file__).parent
    leaves = {k.rpartition(".")[2] for k in keys}
    constants = (package / "runtime/constants.py").read_text()
    unread = set(re.findall(r"^[A-Z0-9_]+ = [\"']([a-z][a-z0-9_]*)[\"']", constants, re.M)) - leaves
    config_named = {m for ms in members.values() for m in ms if m in leaves}
    return {
        "version": deepspeed.__version__,
        "member_rule": "dir(cls) and self.X assignments in the DeepSpeed classes of its MRO, "
        "less dir() and vars() of torch.nn.Module() and torch.optim.Optimizer",
        "members": members,
        "engine_members_rule": "dir(cls) and self.X assignments, torch's included, of "
        "DeepSpeedEngine and PipelineEngine, and module",
        "engine_members": sorted(m for m in engine_members if "__" not in m),
        "generic_members": sorted(GENERIC | config_named),
        "removed_keys_rule": "config blocks DeepSpeedConfig refuses as removed features",
        "removed_keys": sorted(removed),
        "ds_attribute_rule": "x.ds_* and getattr(x, 'ds_*') in DeepSpeed's source, x not self, "
        "less its module names",
        "ds_attributes": _ds_attributes(package),
        "config_keys": dict(sorted(keys.items())),
        "constants_py_not_read": sorted(unread),  # values, or keys DeepSpeedConfig never reads
    }


def _self_attributes(cls) -> set:
    sources = [inspect.getsource(k) for k in cls.__mro__ if k.__module__.startswith("deepspeed")]
    nodes = [n for s in sources for n in ast.walk(ast.parse(textwrap.dedent(s)))]
    stores = [n for n in nodes if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)]
    return {n.attr for n in stores if getattr(n.value, "id", "") == "self"}


def _ds_attributes(package: pathlib.Path) -> list:
    found, modules = set(), set()
    for f in package.rglob("*.py"):
        modules |= {f.stem, f.parent.name}
        pairs = re.findall(r"(?<!self)\.(ds_\w+)|attr\(\w+, [\"'](ds_\w+)", f.read_text())
        found |= {a or b for a, b in pairs}
    return sorted(found - modules)


def _probe(DeepSpeedConfig) -> set:
    """Key paths DeepSpeedConfig looks up in a dict: the top level, then in each block."""
    seen = set()

    class Probe(dict):
        def __init__(self, d, path=""):
            super().__init__(d)
            self.path = path

        def _seen(self, k, v):
            seen.add(self.path + k)
            return Probe(v, f"{self.path}{k}.") if type(v) is dict else v

        def __contains__(self, k):
            return self._seen(k, super().__contains__(k))

        def get(self, k, default=None):
            return self._seen(k, super().get(k, default))

        def __getitem__(self, k):
            return self._seen(k, super().__getitem__(k))

        def keys(self):  # so that `k in d.keys()` is seen too
            return self

    DeepSpeedConfig(Probe({"train_batch_size": 1}))
    for block in sorted(seen):
        with contextlib.suppress(Exception):  # a scalar given a dict fails after being read
            DeepSpeedConfig(Probe({"train_batch_size": 1, block: {"type": "AdamW", "params": {}}}))
    return seen


def _model_keys(model, base, prefix=""):
    for name, field in model.model_fields.items():
        for key in {name, field.alias} - {None}:
            yield prefix + key
            todo = [field.annotation]
            while todo:
                t = todo.pop()
                todo += typing.get_args(t)
                if isinstance(t, type) and issubclass(t, base):
                    yield from _model_keys(t, base, f"{prefix}{key}.")


def python_source(path: str, text: str) -> ast.Module | None:
    """A .py file's AST, or one module of a document's parsable ```python blocks, lines kept."""
    if path.endswith(".py"):
        with contextlib.suppress(SyntaxError):
            return ast.parse(text)
        return None
    body = []
    fence = r"^[ \t]*```[ \t]*(?:python|py)[ \t]*\n(.*?)^[ \t]*```"
    for m in re.finditer(fence, text, re.M | re.S | re.I):
        with contextlib.suppress(SyntaxError):
            block = ast.parse(textwrap.dedent(m[1]))
            body += ast.increment_lineno(block, text.count("\n", 0, m.start(1))).body
    return ast.Module(body=body, type_ignores=[])


def _str(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


class FileScan:
    """The rows of one module (``rows``: line, kind, name[, candidates])."""

    def __init__(self, tree: ast.Module, mentions_ds: bool, ds: dict):
        self.tree, self.ds, self.keys, self.leaves = tree, ds, ds["config_keys"], ds["leaves"]
        self.parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        self.rows, self.bound, self.engines, self.in_chain, self.done = [], {}, {}, set(), set()
        self.imports_and_chains()
        if mentions_ds:
            self.attributes()
            self.config_keys()

    def add(self, node, kind, name, candidates=None):
        row = {"line": node.lineno, "kind": kind, "name": name}
        self.rows.append(row | {"candidates": candidates} if candidates else row)

    def scope(self, node):
        while (node := self.parent.get(node)) is not None:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return node
        return None

    def resolve(self, name: ast.Name):
        s = self.scope(name)
        while (s, name.id) not in self.bound and s is not None:
            s = self.scope(s)
        return self.bound.get((s, name.id))

    def imports_and_chains(self):
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = getattr(node, "module", None)
                for a in node.names:  # a non-DeepSpeed import binds None (shadows)
                    full = f"{module}.{a.name}" if module else a.name
                    ds = full.split(".")[0] == "deepspeed" and not getattr(node, "level", 0)
                    local = a.asname or (a.name if module else a.name.split(".")[0])
                    value = full if module or a.asname else "deepspeed"
                    self.bound[self.scope(node), local] = value if ds else None
                    if ds:
                        self.add(node, "import", full)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                if name := self.resolve(node):
                    self.chain(node, name)

    def chain(self, node, name):
        while isinstance(up := self.parent.get(node), ast.Attribute) and up.value is node:
            node, name = up, f"{name}.{up.attr}"
            self.in_chain.add(node)
        called = getattr(call := self.parent.get(node), "func", None) is node
        if name != "deepspeed":
            self.add(node, "call" if called else "name", name)
        if name == "deepspeed.initialize" and called:  # remember where the engine goes
            up = self.parent.get(call)
            if isinstance(up, ast.Subscript) and getattr(up.slice, "value", None) == 0:
                call, up = up, self.parent.get(up)
            if isinstance(up, ast.Assign) and up.value is call:
                target = up.targets[0]
                target = target.elts[0] if isinstance(target, ast.Tuple) else target
                self.engines[self.scope(up), ast.unparse(target)] = up.lineno

    def attributes(self):
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and node not in self.in_chain:
                self.attribute(node, node.value, node.attr)
            elif (
                isinstance(node, ast.Call)
                and len(node.args) > 1
                and _str(node.args[1])
                and getattr(node.func, "id", "") in ("hasattr", "getattr", "setattr")
            ):
                self.attribute(node, node.args[0], node.args[1].value)

    def attribute(self, node, receiver, attr):
        text = ast.unparse(receiver)
        if self.engines.get((self.scope(node), text), node.lineno + 1) <= node.lineno:
            return self.add(node, "attribute", f"DeepSpeedEngine.{attr}")
        classes = self.ds["index"].get(attr, [])
        last = re.split(r"\W+", text.strip(")]"))[-1].lower()
        hinted = [c for c in classes if any(h in last for h in CLASSES[c][1])]
        if attr.startswith("ds_"):
            wanted = attr in self.ds["ds_attributes"]
        else:
            wanted = classes and (hinted or attr not in self.ds["generic_members"])
        if not wanted or SETTINGS.search(last):
            return None
        classes = hinted or classes
        if len(classes) == 1:
            return self.add(node, "attribute", f"{classes[0]}.{attr}")
        return self.add(node, "attribute", attr, classes)

    def key(self, node, ctx, evidence, key):
        """Record ``key``, found under the keys ``ctx``; return its path if known."""
        if id(node) in self.done:
            return None
        self.done.add(id(node))
        for i in range(len(ctx) + 1):  # anchor ctx on a known path, or on its last key's only path
            if ".".join(ctx[i:]) in self.keys:
                path = ".".join([*ctx[i:], key])
            elif i == len(ctx) and ctx and len(self.leaves.get(ctx[-1], ())) == 1:
                path = f"{self.leaves[ctx[-1]][0]}.{key}"
            else:
                continue
            return self.add(node, "config_key", path) or path if path in self.keys else None
        if key in self.keys:  # a top-level key, or a path ("zero_optimization.stage")
            paths, plain = [key], "." in key or "_" in key and key not in GENERIC
        else:  # a nested key out of context needs evidence
            paths, plain = self.leaves.get(key, []), False
        if not paths or not (evidence or plain):
            return None
        self.add(node, "config_key", paths[0] if len(paths) == 1 else key, paths[1:] and paths)
        return paths[0] if len(paths) == 1 else None

    def access(self, node):
        """(receiver, key node) of X["k"], X.get("k"), X.pop("k"), X.setdefault("k"), or None."""
        if isinstance(node, ast.Subscript) and _str(node.slice):
            return node.value, node.slice
        if (
            isinstance(node, ast.Call)
            and node.args
            and _str(node.args[0])
            and getattr(node.func, "attr", "") in ("get", "pop", "setdefault")
        ):
            return node.func.value, node.args[0]
        return None

    def context(self, receiver):
        """The string keys that lead to ``receiver``, and whether it is named like a DS config."""
        ctx = []
        while (a := self.access(receiver)) is not None:
            receiver, k = a
            ctx.insert(0, k.value)
        return ctx, bool(DS_RECEIVER.search(ast.unparse(receiver)))

    def items(self, node):
        if isinstance(node, ast.Dict):
            return [(k, k.value, v) for k, v in zip(node.keys, node.values, strict=True) if _str(k)]
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "dict":
            return [(kw, kw.arg, kw.value) for kw in node.keywords if kw.arg]
        return None

    def config_dict(self, node, ctx, evidence):
        self.done.add(id(node))
        items = self.items(node)
        if not evidence:  # a dict whose keys mostly sit in one DeepSpeed block is that block
            pairs = [(p.rpartition(".")[0], k) for _, k, _ in items for p in self.leaves.get(k, ())]
            best = Counter(p for p, _ in pairs).most_common(2) + [("", 0)]
            sure = any(p == best[0][0] and "_" in k and k not in GENERIC for p, k in pairs)
            if sure and best[0][1] >= max(2, len(items) / 2) and best[0][1] > best[1][1]:
                ctx, evidence = [p for p in best[0][0].split(".") if p], True
        for k_node, k, v in items:  # a value holding its own keys is evidence too
            inner = [f"{p}.{i}" for p in self.leaves.get(k, ()) for _, i, _ in self.items(v) or ()]
            path = self.key(k_node, ctx, evidence or any(i in self.keys for i in inner), k)
            if self.items(v) is not None:
                self.config_dict(v, path.split(".") if path else [*ctx, k], evidence and bool(path))

    def config_keys(self):
        for node in ast.walk(self.tree):
            if id(node) in self.done:
                continue
            if (a := self.access(node)) is not None:
                self.key(a[1], *self.context(a[0]), a[1].value)
            elif (
                isinstance(node, ast.Compare)
                and _str(node.left)
                and isinstance(node.ops[0], (ast.In, ast.NotIn))
            ):
                self.key(node.left, *self.context(node.comparators[0]), node.left.value)
            elif self.items(node) is not None:  # a dict, maybe assigned to cfg["block"]
                up = self.parent.get(node)
                a = isinstance(up, ast.Assign) and up.value is node and self.access(up.targets[0])
                ctx, evidence = self.context(a[0]) if a else ([], False)
                self.config_dict(node, [*ctx, a[1].value] if a else ctx, evidence)
            elif _str(node) and "." in node.value and node.value in self.keys:
                self.key(node, [], True, node.value)  # "zero_optimization.stage"


def scan(label: str, version: str, files, ds: dict) -> list[dict]:
    """Rows for ``files``, (path relative to the source root, text) pairs."""
    rows = []
    for path, text in files:
        if (tree := python_source(path, text)) is not None:
            for row in FileScan(tree, "deepspeed" in text.lower(), ds).rows:
                rows.append({"package": label, "version": version, "file": path} | row)
    return rows


def git(repo, *args) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout


def read_source(where: str, what: list[str], repos: pathlib.Path):
    """The version or commit and the (path, text) pairs of one row of SOURCES."""
    kind, name = where.split(":")
    if kind == "pip":
        root = pathlib.Path(sysconfig.get_paths()["purelib"])
        files = [
            (f.relative_to(root).as_posix(), f.read_text(errors="replace"))
            for f in sorted((root / name).rglob("*.py"))
        ]
        wanted = lambda p, t: "*" in what or p.split("/", 1)[1] in what or IMPORTS_DS.search(t)
        return importlib.metadata.version(name), [(p, t) for p, t in files if wanted(p, t)]
    repo = repos / name.replace("/", "+")
    names = git(repo, "ls-tree", "-r", "--name-only", "HEAD", "--", *what).decode().split("\n")
    names = [n for n in names if n.endswith((".py", ".md", ".rst"))]
    with tarfile.open(fileobj=io.BytesIO(git(repo, "archive", "HEAD", "--", *names))) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        files = [(m.name, tar.extractfile(m).read().decode(errors="replace")) for m in members]
    return git(repo, "rev-parse", "HEAD").decode().strip(), files


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repos", type=pathlib.Path, default="REPOS", help="git repos, owner+name")
    ap.add_argument("--write", type=pathlib.Path, help="write the JSON here (else print it)")
    args = ap.parse_args()
    ds = introspect()
    lookup = {"index": defaultdict(list), "leaves": defaultdict(list)}
    for cls, names in ds["members"].items():
        for n in names:
            lookup["index"][n].append(cls)
    for k in ds["config_keys"]:
        lookup["leaves"][k.rpartition(".")[2]].append(k)
    sources, rows = [], []
    for line in SOURCES.strip().split("\n"):
        label, where, *what = line.split()
        shown = ["every .py file" if w == "*" else w for w in what if w != "-"]
        if where.startswith("pip:") and "*" not in what:
            shown.append("and files importing deepspeed")
        from_ = " ".join([where, *shown])
        sources.append(source := {"package": label, "version": None, "from": from_})
        try:
            source["version"], files = read_source(where, what, args.repos)
        except (OSError, subprocess.CalledProcessError) as exc:
            source["error"] = f"not read: {getattr(exc, 'stderr', b'').decode().strip() or exc}"
            continue
        rows += scan(label, source["version"], files, ds | lookup)
    rows = sorted(
        {json.dumps(r): r for r in rows}.values(),
        key=lambda r: (r["package"], r["file"], r["line"], r["kind"], r["name"]),
    )
    ds["absent"] = absent_in_deepspeed(
        {r["name"] for r in rows if r["kind"] in ("import", "call", "name")}
    )
    text = json.dumps(
        {"command": COMMAND, "sources": sources, "deepspeed": ds, "rows": rows}, indent=1
    )
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text + "\n")
    else:
        print(text)
    summary(rows, sys.stdout if args.write else sys.stderr)


def absent_in_deepspeed(names) -> list[str]:
    """The dotted ``deepspeed.*`` names real code reaches for that DeepSpeed 0.19.8 itself does
    not have (transformers' guarded ``deepspeed.utils.is_initialized``, say). A module that is
    there but fails to import here (an op without its compiler) counts as there."""
    out = []
    for name in sorted(names):
        parts, obj, broken = name.split("."), None, False
        for i in range(len(parts), 0, -1):
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    obj = importlib.import_module(".".join(parts[:i]))
                break
            except ModuleNotFoundError as exc:
                if exc.name is not None and not ".".join(parts[:i]).startswith(exc.name):
                    broken = True  # it is there; what it imports (triton) is not
                    break
                continue
            except Exception:  # noqa: BLE001 - it exists, and cannot be imported on this machine
                broken = True
                break
        found = broken or obj is not None
        for attr in parts[i:] if obj is not None and not broken else []:
            if not hasattr(obj, attr):
                found = False
                break
            obj = getattr(obj, attr)
        if not found:
            out.append(name)
    return out


def summary(rows, file):
    """Distinct names per package and kind, and over all packages."""
    kinds, distinct, count = sorted({r["kind"] for r in rows}), defaultdict(set), defaultdict(int)
    for r in rows:
        for p in (r["package"], "(all)"):
            distinct[p, r["kind"]].add(r["name"])
            count[p] += 1
    print(f"{'distinct names':<22}" + "".join(f"{k:>12}" for k in kinds) + "    rows", file=file)
    for p in sorted(count, key=lambda p: (p == "(all)", p.lower())):
        counts = "".join(f"{len(distinct[p, k]):>12}" for k in kinds)
        print(f"{p:<22}{counts}{count[p]:>8}", file=file)


if __name__ == "__main__":
    main()
