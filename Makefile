# kvroute — the two commands a newcomer needs:
#   make up     set up the project-local venv, then run the gateway + local workers
#   make test   set up the project-local venv, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
WORKERS ?=
ARGS ?=

.PHONY: venv up test test-slow test-all lint bench clean

# torch (only the worker processes import it) is pinned to torch==2.13.0 by the `worker` extra.
# TORCH picks which build of it the venv gets:
#   TORCH=      (default) whatever pip resolves with its own configuration (pip.conf, PIP_*):
#               from PyPI that is, on Linux x86_64, the CUDA build with NVIDIA's runtime wheels
#               (several GB); a configured local index or wheel folder may offer the CPU build.
#   TORCH=cpu   the CPU build from PyTorch's CPU index (TORCH_INDEX_cpu), installed first; the
#               extra then finds torch satisfied.
#   TORCH=gpu   the CUDA 12.8 build from PyTorch's cu128 index (TORCH_INDEX_gpu), the same way
#               (the wheels bundle the CUDA runtime; the host needs an NVIDIA driver).
# TORCH_INDEX overrides the index. The choice applies when the venv is made: `make clean` first
# to switch an existing one.
TORCH ?=
TORCH_INDEX_cpu := https://download.pytorch.org/whl/cpu
TORCH_INDEX_gpu := https://download.pytorch.org/whl/cu128
TORCH_INDEX ?= $(TORCH_INDEX_$(TORCH))
$(STAMP): pyproject.toml
	@case "$(TORCH)" in ""|cpu|gpu) ;; *) echo "TORCH=$(TORCH): use cpu, gpu or leave it unset"; exit 2;; esac
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q --disable-pip-version-check --index-url '$(TORCH_INDEX)' 'torch==2.13.0')
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,worker,loadtest]'
	touch $(STAMP)

venv: $(STAMP)

# Real engine workers on the bundled tiny model (its weights are generated on the first start):
# WORKERS=N (default: min(4, CPU cores)), ARGS="--port 8001 --events-base-port 30000 ..." (kvroute up --help).
up: $(STAMP)
	$(VENV)/bin/kvroute up $(if $(WORKERS),--workers $(WORKERS)) $(ARGS)

# The simulated fleet (H200 Llama-3.1-8B profile; ARGS="--profile tiny-cpu" for the tiny model's).
.PHONY: up-sim
up-sim: $(STAMP)
	$(VENV)/bin/kvroute up --sim --workers $(or $(WORKERS),4) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(ARGS)

# ruff over the tree; mypy over every package (strict where pyproject says so).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy kvindex kvwire router workers loadtest kvroute

# The adversarial suite (docs/harden.md): a real gateway and workers, every case, one table;
# exit 1 on any hung/lost/wrong answer or disallowed 5xx. SIZE=full: the issue's numbers; CASES=a,b.
.PHONY: harden
harden: $(STAMP)
	$(VENV)/bin/kvroute loadtest harden --size $(or $(SIZE),small) $(if $(CASES),--cases $(CASES)) $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -m '' $(ARGS)

bench: $(STAMP)
	@failed=""; for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || failed="$$failed $$b"; done; \
	if [ -n "$$failed" ]; then echo "failed:$$failed (the trace benchmarks need LOADTEST_TRACES)"; exit 1; fi

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# ---- mutation testing (docs/mutation.md): mutmut 3.8.1, one scratch copy per module group ----
#   make mutation                                  every group, full runs
#   make mutation MUT_GROUPS="planner kvwire"      some groups
#   make mutation MUT_SAMPLE=200 MUT_SEED=205      a fixed-seed simple random sample of 200 mutants per group
#   make mutation MUT_GROUPS=gateway_pool MUT_SAMPLE=200 MUT_RETEST=1
#                                                  re-test only the (sampled) mutants not killed before
#   make mutation ... MUT_RETEST=names.txt         ... only those of them named in the file (one a line)
#   make mutation ... MUT_DESELECT="tests/x.py::test_y"   leave tests out (named in score.txt)
# Each group runs in $(MUT_DIR)/<group>/, a copy of the working tree (tracked + untracked, not ignored)
# taken when the group starts, with its own [tool.mutmut] table; results: score.txt, results.txt
# (every verdict), survivors.txt. Re-runs are incremental (mutants/ is kept; mutmut re-tests changed
# functions, and every mutant again when the group's test files or pytest arguments changed). A sample
# is re-tested whole unless MUT_RETEST is set: a killed mutant stays killed when tests are only
# added, so after writing tests against survivors that re-test gives a whole run's verdicts in a
# fraction of its time (add the tests to files already in the group's selection: a new file resets).
# MUT_JOBS: mutants run at once (1 leaves the other cores to others; the run is niced as well).
MUT_DIR    ?= build/mutation
MUT_JOBS   ?= 1
MUT_NICE   ?= nice -n 10
MUT_SEED   ?= 205
MUT_SAMPLE ?=
MUT_RETEST ?=
# A mutant is a timeout (an endless loop, outside the score) past this many times its tests' CPU
# time, doubled (mutmut's default 15 makes one endless loop cost minutes).
MUT_TIMEOUT_X ?= 3.0
# Test ids to leave out of every group's runs (mutmut needs the selected tests green on the copy:
# a test that fails there, e.g. on another change in progress, can only be left out and named).
MUT_DESELECT ?=
MUT_GROUPS ?= planner kvindex kvwire gateway_pool router_model
MUT_SRC    := router kvindex kvwire kvroute loadtest workers
MUT_COPY   := configs bench scripts
# What each group mutates, and the tests that exercise it (those importing it or driving it in-process).
MUT_only_planner       := router/planner/*
MUT_tests_planner       = $(wildcard tests/planner/test_planner_*.py)
MUT_only_kvindex       := kvindex/*
MUT_tests_kvindex       = $(wildcard tests/index/test_*.py)
MUT_only_kvwire        := kvwire/*
MUT_tests_kvwire        = $(wildcard tests/planner/test_planner_fleet.py tests/engine/test_worker_openapi.py tests/gateway/test_router_units.py \
                            tests/gateway/test_gateway_api.py tests/gateway/test_gateway_hardening.py)
MUT_only_gateway_pool  := router/gateway*.py router/fleet/pool*.py router/intake/prepare.py router/intake/keyplan.py \
                          router/upstream/prefetch.py router/upstream/attempt.py router/upstream/relay.py
MUT_tests_gateway_pool  = $(filter-out tests/gateway/test_gateway_sim.py,$(wildcard tests/gateway/test_gateway_*.py tests/gateway/test_pool_*.py \
                            tests/gateway/test_fake_worker.py tests/gateway/test_router_units.py))
# Left out: tests/gateway/test_gateway_sim.py (a simulated cluster in a child process, whose timing on a
# busy machine makes its cache assertions fail at random: a random failure aborts mutmut's stats
# run, or counts as a kill); tests that run the gateway as a child process (signals, replicas on
# one port): a mutant is not reliably active in a child, and under mutmut's stats run such a test
# can hang; and one that bounds its own wall time tightly (2 s), which mutmut's tracing exceeds.
MUT_skip_gateway_pool  := tests/gateway/test_gateway_hardening.py::test_a_prompt_too_long_by_its_characters_is_refused_unread \
                          tests/gateway/test_gateway_ops.py::test_sigterm_stops_taking_work_gracefully_and_exits_clean \
                          tests/gateway/test_gateway_ops.py::test_sighup_reloads_the_worker_list_and_logs_the_diff \
                          tests/gateway/test_gateway_ops.py::test_serve_processes_runs_replicas_on_one_port \
                          tests/gateway/test_gateway_ops.py::test_processes_needs_a_fixed_port
MUT_only_router_model  := loadtest/router_model.py
MUT_tests_router_model  = $(wildcard tests/loadtest/test_loadtest_simulate.py tests/loadtest/test_router_model_*.py)
MUT      := $(abspath $(VENV))/bin/mutmut
MUT_PY   := $(abspath $(PY))
toml_list = [$(foreach x,$(1),"$(x)",)]
# Counts the verdicts of results.txt (only the sampled keys when sample.txt exists) into score.txt:
# score = killed / (killed + survived); timeouts and "no tests" are reported, outside the score.
define MUT_SCORE
import collections, math, os, sys
res = dict(l.strip().rsplit(": ", 1) for l in open("results.txt") if ": " in l)
keys = [k.strip() for k in open("sample.txt") if k.strip()] if os.path.exists("sample.txt") else list(res)
c = collections.Counter(res.get(k, "not checked") for k in keys)
k, s = c["killed"], c["survived"]
p = k / (k + s) if k + s else float("nan")
n, N = k + s, len(res)
ci = 1.96 * math.sqrt(p * (1 - p) / n * (N - len(keys)) / max(N - 1, 1)) if n and len(keys) < N else 0.0
out = (f"{sys.argv[1]}: mutants={N} tested={len(keys)} killed={k} survived={s} timeout={c['timeout']} "
       f"no_tests={c['no tests']} other={len(keys) - k - s - c['timeout'] - c['no tests']} "
       f"score={100 * p:.1f}%" + (f" +-{100 * ci:.1f}pp (95%, sample)" if ci else ""))
print(out); open("score.txt", "w").write(out + "\n")
endef
export MUT_SCORE

.PHONY: mutation
mutation: $(addprefix mutation-,$(MUT_GROUPS))
	@cat $(foreach g,$(MUT_GROUPS),$(MUT_DIR)/$(g)/score.txt)

$(VENV)/.mutmut: | $(STAMP)
	$(PY) -c 'import mutmut' 2>/dev/null || $(PY) -m pip install -q --disable-pip-version-check 'mutmut==3.8.1'
	touch $@

mutation-%: $(VENV)/.mutmut
	@test -n "$(MUT_only_$*)" || { echo "unknown mutation group '$*' (known: planner kvindex kvwire gateway_pool router_model)"; exit 2; }
	@echo "== mutation $*: mutate $(MUT_only_$*) | tests $(MUT_tests_$*)"
	@d=$(MUT_DIR)/$*; mkdir -p $$d && \
	find $$d -mindepth 1 -maxdepth 1 ! -name mutants -exec rm -rf {} + && \
	git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -cf - -T - 2>/dev/null | tar -xf - -C $$d && \
	awk '/^\[tool\.mutmut\]/{s=1;next} /^\[/{s=0} !s' pyproject.toml > $$d/pyproject.toml && \
	printf '%s\n' '' '[tool.mutmut]' \
	  'source_paths = $(call toml_list,$(MUT_SRC))' \
	  'only_mutate = $(call toml_list,$(MUT_only_$*))' \
	  'also_copy = $(call toml_list,$(MUT_COPY))' \
	  'timeout_multiplier = $(MUT_TIMEOUT_X)' \
	  'pytest_add_cli_args = ["-p", "no:cacheprovider", "--hypothesis-seed=0", $(foreach t,$(MUT_skip_$*) $(MUT_DESELECT),"--deselect", "$(t)",)]' \
	  'pytest_add_cli_args_test_selection = $(call toml_list,$(MUT_tests_$*))' >> $$d/pyproject.toml && \
	cd $$d && rm -f sample.txt retest.txt && \
	if [ -n "$(MUT_SAMPLE)$(MUT_RETEST)" ]; then \
	  $(MUT_NICE) $(MUT) run --max-children $(MUT_JOBS) __generate_only__ >generate.log 2>&1; \
	fi; \
	if [ -n "$(MUT_SAMPLE)" ]; then \
	  $(MUT_PY) -c 'import glob,json,random,sys; k=sorted(x for m in glob.glob("mutants/**/*.py.meta",recursive=True) for x in json.load(open(m))["exit_code_by_key"]); open("sample.txt","w").write("\n".join(random.Random(int(sys.argv[1])).sample(k,len(k))[:int(sys.argv[2])])+"\n")' $(MUT_SEED) $(MUT_SAMPLE); \
	fi; \
	if [ -n "$(MUT_RETEST)" ]; then \
	  $(MUT) results --all true | sed -n 's/^ *\(.*\): \(.*\)$$/\1 \2/p' | awk '$$2 != "killed" {print $$1}' > retest.txt; \
	  if [ -f sample.txt ]; then grep -Fx -f sample.txt retest.txt > retest.tmp; mv retest.tmp retest.txt; fi; \
	  if [ -f "$(abspath $(MUT_RETEST))" ]; then grep -Fx -f "$(abspath $(MUT_RETEST))" retest.txt > retest.tmp; \
	    mv retest.tmp retest.txt; fi; \
	  echo "   re-testing $$(wc -l < retest.txt) mutants not killed before"; \
	  if [ -s retest.txt ]; then $(MUT_NICE) $(MUT) run --max-children $(MUT_JOBS) $$(cat retest.txt); fi; \
	elif [ -f sample.txt ]; then \
	  $(MUT_NICE) $(MUT) run --max-children $(MUT_JOBS) $$(cat sample.txt); \
	else \
	  $(MUT_NICE) $(MUT) run --max-children $(MUT_JOBS); \
	fi; \
	$(MUT) results --all true > results.txt && \
	grep -v -e ': killed$$' -e ': not checked$$' results.txt > survivors.txt; \
	$(MUT_PY) -c "$$MUT_SCORE" $* && \
	{ [ -z "$(strip $(MUT_skip_$*) $(MUT_DESELECT))" ] || echo "   tests left out: $(strip $(MUT_skip_$*) $(MUT_DESELECT))" >> score.txt; } && \
	echo "   $* -> $$d/{score,results,survivors}.txt"
