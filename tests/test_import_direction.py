"""The project's imports run one way (docs/design.md, "Layout"): kernels <- layers <- tokenizers
<- VAR / MAR <- converters, E-CAR <- sampling <- accelerators <- training. Read from the source (every
`import`, function-local ones included), so a wrong-way arrow fails here, named, before it
turns into an import cycle."""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ('pallas_kernels', 'var_models', 'ecar', 'sampling', 'accel', 'train', 'configs')
# var_models' top-level modules besides its face: tools every subpackage may use.
VAR_MODELS_LEAVES = ('var_models.checkpoint', 'var_models.flop_count')
MODELS = ('var_models.nn', 'var_models.tokenizers', 'var_models.var', 'var_models.mar')
ALLOWED = {
    'pallas_kernels': (),
    'var_models.leaf': (),
    'var_models.nn': ('pallas_kernels',),
    'var_models.tokenizers': ('pallas_kernels', 'var_models.nn'),
    'var_models.var': ('pallas_kernels', 'var_models.leaf', 'var_models.nn', 'var_models.tokenizers'),
    'var_models.mar': ('pallas_kernels', 'var_models.leaf', 'var_models.nn', 'var_models.tokenizers'),
    'var_models.convert': ('pallas_kernels', 'var_models.leaf') + MODELS,
    'var_models': ('pallas_kernels', 'var_models.leaf', 'var_models.convert') + MODELS,
    'ecar': ('pallas_kernels', 'var_models', 'var_models.leaf', 'var_models.convert') + MODELS,
    'sampling': ('pallas_kernels', 'var_models', 'var_models.leaf', 'ecar') + MODELS,
    'accel': ('pallas_kernels', 'var_models', 'var_models.leaf', 'ecar', 'sampling') + MODELS,
    'train': ('pallas_kernels', 'var_models', 'var_models.leaf', 'var_models.convert', 'ecar', 'sampling',
              'accel', 'configs') + MODELS,
    'configs': (),
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _is_module(name: str) -> bool:
  path = ROOT.joinpath(*name.split('.'))
  return path.with_suffix('.py').exists() or (path / '__init__.py').exists()


def unit(module: str) -> str | None:
  """The layer a project module belongs to; None for modules outside the project."""
  top = module.split('.')[0]
  if top not in PACKAGES:
    return None
  if top != 'var_models' or module == 'var_models':
    return top
  if module in VAR_MODELS_LEAVES:
    return 'var_models.leaf'
  sub = '.'.join(module.split('.')[:2])
  if sub in MODELS + ('var_models.convert',):
    return sub
  raise AssertionError(f'{module} sits at the top of var_models: move it into a subpackage, or add it '
                       'to VAR_MODELS_LEAVES if every subpackage may import it')


def imports(path: pathlib.Path):
  """The project modules `path` imports: (line, dotted name)."""
  me = _module_name(path)
  package = me if path.name == '__init__.py' else me.rpartition('.')[0]
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      yield from ((node.lineno, a.name) for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        anchor = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(anchor + ([base] if base else []))
      for a in node.names:
        name = f'{base}.{a.name}'
        yield node.lineno, name if _is_module(name) else base


def project_files():
  for pkg in PACKAGES:
    yield from sorted((ROOT / pkg).rglob('*.py'))


def test_every_project_module_belongs_to_a_layer():
  for path in project_files():
    assert unit(_module_name(path)) is not None, path


@pytest.mark.parametrize('package', PACKAGES)
def test_imports_run_one_way(package):
  wrong = []
  for path in sorted((ROOT / package).rglob('*.py')):
    src = unit(_module_name(path))
    for line, target in imports(path):
      dst = unit(target)
      if dst is not None and dst != src and dst not in ALLOWED[src]:
        wrong.append(f'{path.relative_to(ROOT)}:{line} imports {target}: {src} may import only '
                     f'{sorted(ALLOWED[src]) or "nothing of the project"}')
  assert not wrong, '\n'.join(wrong)


def test_the_checker_sees_a_wrong_way_arrow(tmp_path, monkeypatch):
  fake = tmp_path / 'var_models' / 'nn' / 'bad.py'
  fake.parent.mkdir(parents=True)
  fake.write_text('def f():\n  from var_models.var import sampler\n')
  (tmp_path / 'var_models' / 'var').mkdir()
  (tmp_path / 'var_models' / 'var' / 'sampler.py').write_text('')
  monkeypatch.setattr(sys.modules[__name__], 'ROOT', tmp_path)
  [(line, target)] = list(imports(fake))
  assert (line, target, unit(target)) == (2, 'var_models.var.sampler', 'var_models.var')
  assert unit(target) not in ALLOWED[unit(_module_name(fake))]


def test_plain_sampling_imports_no_accelerator():
  """Training's grids, `train.sample` and `train.evaluate` without --policy sample through `sampling` alone."""
  for module in ('train.sample', 'train.evaluate', 'train.trainer'):   # each defines its command line's flags
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'accel'))"
    out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == '[]', (module, out)
