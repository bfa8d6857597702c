# gurtd: `make run` and `make test` do all the set-up on a fresh Debian 12 as root.
PYTHON ?= /usr/bin/python3
VENV := .venv
PREFIX ?= /usr/local
BOX_HOME ?= /var/lib/gurt
LISTEN ?= 127.0.0.1:7700
# nftables, iproute2, util-linux: the system tools; libcap-dev, gcc, python3-dev: to build
# python-prctl; python3-venv: the virtual environment; systemd: systemd-analyze for the tests;
# python3-click: the `gurtd` command inside a task (its tool client) runs on the system python;
# python3-seccomp: libseccomp's own Python binding (not on PyPI), for the tasks' kernel filter;
# e2fsprogs, mount: mkfs.ext4 and losetup for the full-disk tests (a small loop-mounted image).
# git: `git merge-file`, the three-way merge of two tasks that changed one file side by side.
APT_PACKAGES := nftables iproute2 util-linux libcap-dev gcc python3-dev python3-venv curl systemd \
  python3-click python3-seccomp e2fsprogs mount git
# Only the tests and the bench: the portal's tests drive a real headless browser; the README's
# zsh and fish examples (shell completion) run in those shells.
TEST_APT_PACKAGES := chromium chromium-driver zsh fish

# Is a Debian package installed (not only known: a removed one keeps its config files' record)?
INSTALLED = test "$$(dpkg-query -W -f='$${db:Status-Status}' $(1) 2>/dev/null)" = installed

DROID_VERSION := 0.215.0
DROID := $(VENV)/droid/node_modules/droid/bin/droid

.PHONY: apt deps test-deps link run test test-pure vm-deps vm-image test-vm bench install uninstall clean

deps: $(VENV)/.installed $(VENV)/.seccomp $(VENV)/.droid-$(DROID_VERSION)

# Install those of the Debian packages $(1) that are missing (apt-get options in $(2)).
APT_MISSING = @missing=""; for p in $(1); do \
	  $(call INSTALLED,$$p) || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) $$missing; fi

# The Debian packages gurtd and its tests need, those missing only.
apt:
	$(call APT_MISSING,$(APT_PACKAGES))

# The checkout's venv: run-time and test packages (requirements-test.txt includes the other).
$(VENV)/.installed: requirements.txt requirements-test.txt | apt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements-test.txt
	touch $@

# The venv gets the one module of python3-seccomp, linked into its site-packages, rather than
# every system package (--system-site-packages would shadow the pinned requirements).
SECCOMP_LINK = ln -sf "$$($(PYTHON) -c 'import seccomp; print(seccomp.__file__)')" \
  "$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/"

$(VENV)/.seccomp: $(VENV)/.installed
	$(call INSTALLED,python3-seccomp) || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-seccomp; }
	$(call SECCOMP_LINK,$(VENV))
	$(VENV)/bin/python -c 'import seccomp'
	touch $@

# Node.js and npm from Debian when `npm` is missing (the Droid CLI's installer).
NPM = command -v npm >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm; }

# The Droid CLI, pinned, from the npm registry (its package ships the native binary);
# Node.js and npm from Debian when missing.
$(VENV)/.droid-$(DROID_VERSION): $(VENV)/.installed
	$(NPM)
	npm install --prefix $(VENV)/droid --no-audit --no-fund --loglevel=error \
	  droid@$(DROID_VERSION)
	test "$$($(DROID) --version)" = "$(DROID_VERSION)"
	touch $@

# Debian packages only the tests and the bench use: the portal's browser, the README's shells.
$(VENV)/.test-installed: $(VENV)/.installed
	$(call APT_MISSING,$(TEST_APT_PACKAGES))
	touch $@

# Everything `make test` and `make bench` install.
test-deps: deps $(VENV)/.test-installed

run: deps link
	BOX_HOME=$(BOX_HOME) $(VENV)/bin/python gurtd.py serve --listen $(LISTEN)

# The `gurtd` command on the PATH, for this checkout: $(PREFIX)/bin/gurtd runs its gurtd.py
# with its venv (`make install` writes its own in the same place).
link:
	install -d $(PREFIX)/bin
	printf '#!/bin/sh\nexec $(CURDIR)/$(VENV)/bin/python $(CURDIR)/gurtd.py "$$@"\n' \
	  > $(PREFIX)/bin/gurtd
	chmod 0755 $(PREFIX)/bin/gurtd

test: test-deps
	$(VENV)/bin/python -m pytest -v -p no:cacheprovider tests

# The pure tier (tests marked `pure`, see tests/conftest.py): no gurtd, no root, seconds.
test-pure: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -m pure tests

# The VM tier: a stock Debian 12 guest under qemu (Debian's kernel, systemd as PID 1, pure
# cgroup v2, no network device) where gurtd is installed with `make install` and driven by
# systemctl (tests/vm/).  Its image is built once, cached under /var/cache/gurtd-vm/ by a
# hash of what goes into it: these packages, requirements.txt, the Droid CLI and pytest.
VM_APT_PACKAGES := qemu-system-x86 qemu-utils debootstrap
VM_ENV = APT_PACKAGES="$(APT_PACKAGES)" DROID_VERSION=$(DROID_VERSION) PYTHON=$(PYTHON) \
  PYTEST="$$(grep '^pytest==' requirements-test.txt)"
# The image's npm cache is filled by this machine's npm (its registry and certificates).
vm-deps: apt
	$(call APT_MISSING,$(VM_APT_PACKAGES),--no-install-recommends)
	$(NPM)

# The image alone, built and cached (test-vm builds it too when it is missing): .ci/run builds
# it beside the suite, as debootstrap waits on the archive and the disk more than the cores.
vm-image: vm-deps
	$(VM_ENV) tests/vm/run.sh image

test-vm: vm-deps
	$(VM_ENV) tests/vm/run.sh

bench: test-deps
	$(VENV)/bin/python tests/bench.py

# Only what gurtd needs at run time: requirements.txt into its own venv (no test packages).
# gurtd runs as a module from bytecode made here (gurtd.pth puts its folder on the venv's path):
# run as a script it was compiled again at each start, 20 s of the unit's start in a VM, its
# folder being read-only to it.  -P: the folder gurtd is called from is not searched first.
install: apt
	install -d $(PREFIX)/lib/gurtd $(PREFIX)/bin /etc/systemd/system
	install -m 0644 gurtd.py portal.html requirements.txt README.md $(PREFIX)/lib/gurtd/
	$(PYTHON) -m venv $(PREFIX)/lib/gurtd/venv
	$(PREFIX)/lib/gurtd/venv/bin/pip install -q --disable-pip-version-check \
	  -r $(PREFIX)/lib/gurtd/requirements.txt
	$(call SECCOMP_LINK,$(PREFIX)/lib/gurtd/venv)
	$(NPM)
	npm install --prefix $(PREFIX)/lib/gurtd/droid --no-audit --no-fund --loglevel=error \
	  droid@$(DROID_VERSION)
	$(PREFIX)/lib/gurtd/venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))' \
	  | { read -r site; echo $(PREFIX)/lib/gurtd > "$$site/gurtd.pth"; }
	$(PREFIX)/lib/gurtd/venv/bin/python -m py_compile $(PREFIX)/lib/gurtd/gurtd.py
	printf '#!/bin/sh\nexec $(PREFIX)/lib/gurtd/venv/bin/python -P -m gurtd "$$@"\n' \
	  > $(PREFIX)/bin/gurtd
	chmod 0755 $(PREFIX)/bin/gurtd
	sed 's|/usr/local|$(PREFIX)|g' gurtd.service > /etc/systemd/system/gurtd.service
	if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi

uninstall:
	if [ -d /run/systemd/system ]; then systemctl disable --now gurtd || true; fi
	rm -rf $(PREFIX)/lib/gurtd $(PREFIX)/bin/gurtd /etc/systemd/system/gurtd.service
	if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi

clean:
	rm -rf $(VENV)
