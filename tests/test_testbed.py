"""Offline checks of the study's AWS testbed as code (deploy/aws/): the Terraform (python-hcl2 and
HashiCorp's terraform-config-inspect), the Ansible playbooks (syntax check, ansible-lint production
profile), and the tools `scripts/k8s-tools` fetches from Debian trixie. Nothing here touches AWS."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import hcl2
import jinja2
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
AWS = ROOT / "deploy" / "aws"
TF = AWS / "terraform"
ANSIBLE = AWS / "ansible"
K8S_TOOLS = ROOT / "scripts" / "k8s-tools"
# The venv's bin dir (not resolved: the venv's python is a symlink to the system one).
VENV_BIN = Path(sys.executable).parent
TOOL_NAMES = {"kubectl", "kustomize", "terraform-config-inspect"}
VPC_ONLY_PORTS = {10250, 7070, 5000}  # kubelet, podmigrate node agent, checkpoint registry

# --- helpers ---------------------------------------------------------------------------------


def _clean(value: Any) -> Any:
    """python-hcl2 keeps the quotes of string literals and block labels and adds bookkeeping keys."""
    if isinstance(value, dict):
        return {
            _clean(k): _clean(v)
            for k, v in value.items()
            if k not in ("__is_block__", "__comments__", "__start_line__")
        }
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


class Terraform:
    def __init__(self, directory: Path) -> None:
        self.files = sorted(directory.glob("*.tf"))
        self.variables: dict[str, dict[str, Any]] = {}
        self.resources: dict[tuple[str, str], dict[str, Any]] = {}
        self.data: dict[tuple[str, str], dict[str, Any]] = {}
        self.outputs: dict[str, dict[str, Any]] = {}
        self.locals: dict[str, Any] = {}
        self.terraform: list[dict[str, Any]] = []
        for f in self.files:
            with f.open() as fh:
                doc = _clean(hcl2.load(fh))
            for block in doc.get("variable", []):
                self.variables.update(block)
            for block in doc.get("output", []):
                self.outputs.update(block)
            for block in doc.get("locals", []):
                self.locals.update(block)
            for kind, target in (("resource", self.resources), ("data", self.data)):
                for block in doc.get(kind, []):
                    for rtype, named in block.items():
                        for name, body in named.items():
                            target[(rtype, name)] = body
            self.terraform += doc.get("terraform", [])

    def resolve_int(self, expr: Any) -> int:
        if isinstance(expr, int):
            return expr
        m = re.fullmatch(r"\$\{local\.(\w+)\}", str(expr))
        assert m, f"not a number or a local: {expr!r}"
        return int(self.locals[m.group(1)])


@pytest.fixture(scope="module")
def tf() -> Terraform:
    return Terraform(TF)


def _env(tmp: Path) -> dict[str, str]:
    """Environment for the Ansible tools: every cache and temp dir under tmp, nothing in the repo."""
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        HOME=str(home),
        ANSIBLE_HOME=str(home / ".ansible"),
        ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-tmp"),
        XDG_CACHE_HOME=str(home / ".cache"),
        NO_COLOR="1",
        ANSIBLE_NOCOLOR="1",
    )
    env.pop("ANSIBLE_CONFIG", None)
    return env


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


def _site_plays() -> list[dict[str, Any]]:
    plays = yaml.safe_load((ANSIBLE / "site.yml").read_text())
    assert isinstance(plays, list)
    return plays


def _site_groups() -> set[str]:
    groups: set[str] = set()
    for play in _site_plays():
        hosts = play["hosts"]
        groups.update([hosts] if isinstance(hosts, str) else hosts)
    return groups


def _ini_groups(text: str) -> set[str]:
    return set(re.findall(r"^\[([\w-]+)(?::children|:vars)?\]", text, re.MULTILINE))


@pytest.fixture(scope="session")
def tools_bin() -> Path:
    """The bin dir of scripts/k8s-tools; installed now if missing (these tests must not be skipped)."""
    tools = Path(os.environ.get("PODMIGRATE_TOOLS", "/var/lib/podmigrate/tools"))
    bin_dir = tools / "bin"
    if not all(os.access(bin_dir / t, os.X_OK) for t in TOOL_NAMES):
        proc = subprocess.run(
            ["bash", str(K8S_TOOLS)], env={**os.environ, "PODMIGRATE_TOOLS": str(tools)}, capture_output=True, text=True
        )
        assert proc.returncode == 0, f"scripts/k8s-tools failed:\n{proc.stderr}"
        assert proc.stdout.strip() == str(bin_dir)
    return bin_dir


# --- Terraform, structure (python-hcl2) -------------------------------------------------------


def test_terraform_files_present(tf: Terraform) -> None:
    names = {f.name for f in tf.files}
    assert {"versions.tf", "variables.tf", "main.tf", "outputs.tf"} <= names
    for extra in ("inventory.tftpl", "terraform.tfvars.example", "README.md"):
        assert (TF / extra).is_file(), extra
    # The top README says plainly that this has never been applied to AWS.
    assert "never applied" in (AWS / "README.md").read_text().lower()


def test_topology_one_control_plane_and_worker_count_workers(tf: Terraform) -> None:
    instances = {name: body for (rtype, name), body in tf.resources.items() if rtype == "aws_instance"}
    assert set(instances) == {"control_plane", "worker"}
    assert "count" not in instances["control_plane"] and "for_each" not in instances["control_plane"]
    assert instances["worker"]["count"] == "${var.worker_count}"
    assert tf.variables["worker_count"]["default"] == 2
    assert tf.variables["worker_count"]["type"] == "number"
    # Instance types are variables, with defaults.
    assert instances["control_plane"]["instance_type"] == "${var.control_plane_instance_type}"
    assert instances["worker"]["instance_type"] == "${var.worker_instance_type}"
    for var in ("control_plane_instance_type", "worker_instance_type"):
        assert re.fullmatch(r"[a-z0-9]+\.[a-z0-9]+", tf.variables[var]["default"]), var
    # Root volume size is a variable on every node; both use the looked-up (or pinned) AMI.
    for body in instances.values():
        assert body["root_block_device"][0]["volume_size"] == "${var.root_volume_gb}"
        assert body["ami"] == "${local.ami_id}"
        assert body["subnet_id"] == "${aws_subnet.public.id}"
        assert body["vpc_security_group_ids"] == ["${aws_security_group.nodes.id}"]
        assert body["key_name"] == "${aws_key_pair.admin.key_name}"


def test_network_resources(tf: Terraform) -> None:
    for key in [
        ("aws_vpc", "main"),
        ("aws_subnet", "public"),
        ("aws_internet_gateway", "main"),
        ("aws_route_table", "public"),
        ("aws_route_table_association", "public"),
        ("aws_security_group", "nodes"),
        ("aws_key_pair", "admin"),
        ("local_file", "ansible_inventory"),
    ]:
        assert key in tf.resources, key
    route = tf.resources[("aws_route_table", "public")]["route"][0]
    assert route["cidr_block"] == "0.0.0.0/0" and route["gateway_id"] == "${aws_internet_gateway.main.id}"
    assert tf.resources[("aws_subnet", "public")]["map_public_ip_on_launch"] is True
    assert "var.ssh_public_key_path" in tf.resources[("aws_key_pair", "admin")]["public_key"]


def test_every_variable_has_description_and_type(tf: Terraform) -> None:
    assert len(tf.variables) >= 15
    for name, body in tf.variables.items():
        assert body.get("description", "").strip(), f"variable {name} has no description"
        assert body.get("type"), f"variable {name} has no type"
    with_validation = {n for n, b in tf.variables.items() if b.get("validation")}
    assert {"worker_count", "root_volume_gb", "ssh_allowed_cidrs", "os_image", "vpc_cidr"} <= with_validation


def test_security_group_keeps_kubelet_agent_registry_inside_vpc(tf: Terraform) -> None:
    sg = tf.resources[("aws_security_group", "nodes")]
    assert "ingress" not in sg, "ingress rules are separate aws_vpc_security_group_ingress_rule resources"
    rules = {n: b for (t, n), b in tf.resources.items() if t == "aws_vpc_security_group_ingress_rule"}
    assert rules
    explicit: set[int] = set()
    for name, rule in rules.items():
        assert rule["security_group_id"] == "${aws_security_group.nodes.id}", name
        assert "cidr_ipv6" not in rule, name
        if rule["ip_protocol"] == "-1":
            ports = VPC_ONLY_PORTS
        else:
            lo, hi = tf.resolve_int(rule["from_port"]), tf.resolve_int(rule["to_port"])
            ports = {p for p in VPC_ONLY_PORTS if lo <= p <= hi}
            if lo == hi:
                explicit.add(lo)
        if ports:
            assert rule["cidr_ipv4"] == "${aws_vpc.main.cidr_block}", f"{name} opens {sorted(ports)} beyond the VPC"
        assert rule["cidr_ipv4"] != "0.0.0.0/0", f"{name} is open to the world"
    assert explicit >= VPC_ONLY_PORTS | {22}
    # SSH only from the allowed CIDRs, and the variable refuses 0.0.0.0/0.
    assert rules["ssh"]["for_each"] == "${toset(var.ssh_allowed_cidrs)}"
    assert rules["ssh"]["cidr_ipv4"] == "${each.value}"
    conditions = " ".join(v["condition"] for v in tf.variables["ssh_allowed_cidrs"]["validation"])
    assert "0.0.0.0/0" in conditions


def test_ami_lookup_and_spot_workers(tf: Terraform) -> None:
    ami = tf.data[("aws_ami", "node")]
    assert ami["owners"] == ["${var.ami_owners[var.os_image]}"]
    assert set(tf.variables["ami_owners"]["default"]) == {"ubuntu-24.04", "debian-12"}
    patterns = tf.locals["ami_name_patterns"]
    assert "debian-12" in patterns["debian-12"] and "noble-24.04" in patterns["ubuntu-24.04"]
    worker = tf.resources[("aws_instance", "worker")]
    market = worker["dynamic"][0]["instance_market_options"]
    assert "var.worker_spot" in market["for_each"]
    assert market["content"][0]["market_type"] == "spot"
    assert tf.variables["worker_spot"]["type"] == "bool" and tf.variables["worker_spot"]["default"] is False


def test_outputs(tf: Terraform) -> None:
    expected = {
        "control_plane_public_ip",
        "control_plane_private_ip",
        "worker_public_ips",
        "worker_private_ips",
        "registry_endpoint",
        "ansible_inventory_path",
    }
    assert expected <= set(tf.outputs)
    for name in expected:
        assert tf.outputs[name].get("description"), name
    assert "aws_instance.worker[*].private_ip" in tf.outputs["worker_private_ips"]["value"]


def test_providers_pinned(tf: Terraform) -> None:
    providers = tf.terraform[0]["required_providers"][0]
    assert providers["aws"]["source"] == "hashicorp/aws"
    assert providers["aws"]["version"].startswith("~> 5.")
    assert providers["local"]["source"] == "hashicorp/local"


def _templatefile_keys(expr: str) -> set[str]:
    """Top-level keys of the object passed to templatefile(...) in an HCL expression string."""
    start = expr.index("{", expr.index("inventory.tftpl"))
    depth = 0
    top = ""  # the text at nesting depth 0 inside the object: "k = v, k2 = v2, ..."
    for ch in expr[start + 1 :]:
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            if depth == 0:
                break
            depth -= 1
        elif depth == 0:
            top += ch
    return set(re.findall(r"(?:^|,)\s*(\w+)\s*=(?!=)", top))


def test_inventory_template_has_site_groups_and_its_variables(tf: Terraform) -> None:
    template = (TF / "inventory.tftpl").read_text()
    groups = _ini_groups(template)
    site = _site_groups()
    assert site == {"k8s_cluster", "control_plane", "workers"}
    assert site <= groups, f"site.yml targets {sorted(site - groups)}, missing from inventory.tftpl"
    assert _ini_groups((ANSIBLE / "inventory.example.ini").read_text()) == groups
    # Every variable the template uses is passed by local_file.ansible_inventory (templatefile fails otherwise).
    content = tf.resources[("local_file", "ansible_inventory")]["content"]
    passed = _templatefile_keys(content)
    loop_vars = set(re.findall(r"%\{\s*for\s+(\w+)\s+in", template))
    used = set(re.findall(r"\$\{\s*([A-Za-z_]\w*)", template)) | set(
        re.findall(r"%\{\s*for\s+\w+\s+in\s+(\w+)", template)
    )
    assert used - loop_vars, "the template uses no variables?"
    assert used - loop_vars <= passed, f"not passed to templatefile: {sorted(used - loop_vars - passed)}"
    # The playbooks rely on these host/group variables.
    for var in ("private_ip=", "ansible_user=", "registry_endpoint="):
        assert var in template, var


# --- Terraform, HashiCorp's parser (terraform-config-inspect) ----------------------------------


def _inspect(tools_bin: Path, directory: Path) -> tuple[int, dict[str, Any]]:
    """terraform-config-inspect's exit status (1 when it has error diagnostics) and its JSON report."""
    proc = subprocess.run(
        [str(tools_bin / "terraform-config-inspect"), "--json", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.stdout.startswith("{"), proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return proc.returncode, result


def test_terraform_config_inspect(tools_bin: Path, tf: Terraform) -> None:
    rc, info = _inspect(tools_bin, TF)
    errors = [d for d in info.get("diagnostics", []) if d.get("severity") == "error"]
    assert not errors, errors
    assert rc == 0
    assert set(info["variables"]) == set(tf.variables)
    assert info["variables"]["worker_count"]["default"] == 2
    assert info["variables"]["ssh_allowed_cidrs"]["required"] is True
    managed = set(info["managed_resources"])
    assert {
        "aws_vpc.main",
        "aws_subnet.public",
        "aws_internet_gateway.main",
        "aws_route_table.public",
        "aws_security_group.nodes",
        "aws_vpc_security_group_ingress_rule.kubelet",
        "aws_key_pair.admin",
        "aws_instance.control_plane",
        "aws_instance.worker",
        "local_file.ansible_inventory",
    } <= managed
    assert set(info["data_resources"]) == {"data.aws_ami.node", "data.aws_availability_zones.available"}
    providers = info["required_providers"]
    assert providers["aws"]["source"] == "hashicorp/aws"
    assert providers["aws"]["version_constraints"] == ["~> 5.0"]
    assert providers["local"]["source"] == "hashicorp/local"
    assert set(info["outputs"]) == set(tf.outputs)


def test_terraform_config_inspect_reports_broken_config(tools_bin: Path, tmp_path: Path) -> None:
    """The diagnostics check above means something: a broken copy does get an error."""
    broken = tmp_path / "tf"
    shutil.copytree(TF, broken)
    with (broken / "main.tf").open("a") as fh:
        fh.write('\nresource "aws_instance" {\n')
    rc, info = _inspect(tools_bin, broken)
    assert rc != 0
    assert any(d.get("severity") == "error" for d in info.get("diagnostics", []))


# --- Ansible -----------------------------------------------------------------------------------


def test_ansible_syntax_check(tmp_path: Path) -> None:
    before = _files(ANSIBLE)
    proc = _run(
        [str(VENV_BIN / "ansible-playbook"), "--syntax-check", "-i", "inventory.example.ini", "site.yml"],
        ANSIBLE,
        _env(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "playbook: site.yml" in proc.stdout
    assert _files(ANSIBLE) == before


def test_ansible_example_inventory_groups(tmp_path: Path) -> None:
    proc = _run([str(VENV_BIN / "ansible-inventory"), "-i", "inventory.example.ini", "--list"], ANSIBLE, _env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    inv = json.loads(proc.stdout)
    assert inv["control_plane"]["hosts"] == ["cp"]
    assert len(inv["workers"]["hosts"]) == 2
    assert set(inv["k8s_cluster"]["children"]) == {"control_plane", "workers"}
    cp = inv["_meta"]["hostvars"]["cp"]
    assert cp["registry_endpoint"] == f"{cp['private_ip']}:5000"


def test_ansible_lint_production_offline(tmp_path: Path) -> None:
    config = yaml.safe_load((ANSIBLE / ".ansible-lint").read_text())
    assert config["offline"] is True
    assert config["profile"] == "production"
    assert not config.get("skip_list") and not config.get("warn_list")
    before = _files(ANSIBLE)
    repo_before = _files(ROOT / "deploy")
    proc = _run([str(VENV_BIN / "ansible-lint"), "--offline", "--nocolor"], ANSIBLE, _env(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Profile 'production' was required, and it passed" in out, out
    assert _files(ANSIBLE) == before and _files(ROOT / "deploy") == repo_before


def _tasks(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for task in yaml.safe_load(path.read_text()) or []:
        out.append(task)
        for key in ("block", "rescue", "always"):
            for inner in task.get(key, []):
                out.append(inner)
    return out


TASK_KEYWORDS = {
    "name", "when", "loop", "register", "notify", "vars", "become", "changed_when", "failed_when", "until",
    "retries", "delay", "environment", "delegate_to", "tags", "block", "rescue", "always", "no_log", "run_once",
    "ignore_errors", "listen", "loop_control",
}  # fmt: skip


def test_only_ansible_builtin_modules() -> None:
    files = sorted((ANSIBLE / "roles").glob("*/tasks/*.yml")) + sorted((ANSIBLE / "roles").glob("*/handlers/*.yml"))
    assert len(files) >= 10
    modules: set[str] = set()
    for f in files:
        for task in _tasks(f):
            if "block" in task:
                continue
            actions = [k for k in task if k not in TASK_KEYWORDS]
            assert len(actions) == 1, f"{f}: {task.get('name')}: {actions}"
            modules.add(actions[0])
    assert all(m.startswith("ansible.builtin.") for m in modules), sorted(modules)
    assert {"ansible.builtin.assert", "ansible.builtin.apt", "ansible.builtin.template"} <= modules
    roles = {r["role"] for play in _site_plays() for r in play["roles"]}
    assert roles == {p.name for p in (ANSIBLE / "roles").iterdir()}


def test_versions_and_criu_assert() -> None:
    v = yaml.safe_load((ANSIBLE / "group_vars" / "all.yml").read_text())
    assert v["crio_minor"] == "1.31"
    assert v["kubernetes_minor"] == "1.31" and v["kubernetes_version"].startswith("1.31.")
    assert v["cilium_version"].startswith("1.16.")
    assert v["criu_min_version"] == "4.2"
    assert v["podmigrate_kustomize_dir"].endswith("/../../kubernetes")
    criu = _tasks(ANSIBLE / "roles" / "criu" / "tasks" / "main.yml")
    asserts = [t["ansible.builtin.assert"] for t in criu if "ansible.builtin.assert" in t]
    assert any("version(criu_min_version, '>=')" in " ".join(a["that"]) for a in asserts)
    apply = _tasks(ANSIBLE / "roles" / "podmigrate" / "tasks" / "main.yml")
    argvs = [t["ansible.builtin.command"].get("argv", []) for t in apply if "ansible.builtin.command" in t]
    assert any("apply" in a and "-k" in a for a in argvs)


def _render(template: Path, **variables: Any) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["bool"] = lambda v: v if isinstance(v, bool) else str(v).lower() in ("yes", "on", "1", "true")
    return env.from_string(template.read_text()).render(ansible_managed="managed", **variables)


def test_kubeadm_config_enables_container_checkpoint() -> None:
    text = _render(
        ANSIBLE / "roles" / "control_plane" / "templates" / "kubeadm-config.yaml.j2",
        private_ip="10.42.1.10",
        ansible_host="198.51.100.10",
        inventory_hostname="cp",
        kubernetes_version="1.31.4",
        kubernetes_pod_subnet="10.244.0.0/16",
        kubernetes_service_subnet="10.96.0.0/12",
    )
    docs = {d["kind"]: d for d in yaml.safe_load_all(text)}
    assert set(docs) == {"InitConfiguration", "ClusterConfiguration", "KubeletConfiguration"}
    assert docs["KubeletConfiguration"]["featureGates"] == {"ContainerCheckpoint": True}
    assert docs["KubeletConfiguration"]["cgroupDriver"] == "systemd"
    assert docs["InitConfiguration"]["nodeRegistration"]["criSocket"] == "unix:///var/run/crio/crio.sock"
    assert docs["ClusterConfiguration"]["kubernetesVersion"] == "v1.31.4"


def test_crio_dropins() -> None:
    templates = ANSIBLE / "roles" / "crio" / "templates"
    conf = _render(templates / "crio-podmigrate.conf.j2", crio_drop_infra_ctr=False, crio_default_runtime="runc")
    assert "[crio.runtime]" in conf
    assert re.search(r"^enable_criu_support = true$", conf, re.MULTILINE)
    assert re.search(r"^drop_infra_ctr = false$", conf, re.MULTILINE)
    reg = _render(templates / "registry.conf.j2", registry_endpoint="10.42.1.10:5000")
    assert 'location = "10.42.1.10:5000"' in reg and "insecure = true" in reg


# --- scripts/k8s-tools --------------------------------------------------------------------------


def test_k8s_tools_bin_dir_and_versions(tools_bin: Path, tmp_path: Path) -> None:
    assert {p.name for p in tools_bin.iterdir()} == TOOL_NAMES
    assert "kubectl_1.32.3+ds-2/" in os.readlink(tools_bin / "kubectl")
    assert "kustomize_5.6.0+ds-1+b2/" in os.readlink(tools_bin / "kustomize")
    kubectl = subprocess.run(
        [str(tools_bin / "kubectl"), "version", "--client", "--output=json"], capture_output=True, text=True, check=True
    )
    assert json.loads(kubectl.stdout)["clientVersion"]["gitVersion"] == "v1.32.3"
    # Debian's kustomize reports "(devel)" as its version, so check it runs and builds.
    version = subprocess.run(
        [str(tools_bin / "kustomize"), "version", "-o", "json"], capture_output=True, text=True, check=True
    )
    assert json.loads(version.stdout)["goOs"] == "linux"
    (tmp_path / "kustomization.yaml").write_text(
        "configMapGenerator:\n- name: probe\n  literals: [mode=stop-copy]\n"
        "generatorOptions:\n  disableNameSuffixHash: true\n"
    )
    for argv in (
        [str(tools_bin / "kustomize"), "build", str(tmp_path)],
        [str(tools_bin / "kubectl"), "kustomize", str(tmp_path)],
    ):
        built = yaml.safe_load(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
        assert built["kind"] == "ConfigMap" and built["data"] == {"mode": "stop-copy"}, argv


def test_k8s_tools_idempotent(tools_bin: Path) -> None:
    proc = subprocess.run(
        ["bash", str(K8S_TOOLS)],
        env={**os.environ, "PODMIGRATE_TOOLS": str(tools_bin.parent)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tools_bin)
    assert proc.stderr.count("already present") == 3, proc.stderr
    assert "downloading" not in proc.stderr


def test_k8s_tools_rejects_a_wrong_checksum(tmp_path: Path) -> None:
    """A .deb whose SHA-256 is not the pinned one is refused and nothing is linked (offline: file:// mirror)."""
    mirror = tmp_path / "mirror"
    deb = mirror / "pool/main/k/kubernetes/kubectl_1.32.3+ds-2_amd64.deb"
    deb.parent.mkdir(parents=True)
    deb.write_bytes(b"not the pinned package")
    tools = tmp_path / "tools"
    proc = subprocess.run(
        ["bash", str(K8S_TOOLS)],
        env={**os.environ, "PODMIGRATE_TOOLS": str(tools), "DEBIAN_MIRROR": f"file://{mirror}"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "SHA-256 mismatch" in proc.stderr, proc.stderr
    assert not (tools / "bin" / "kubectl").exists()
    assert not list((tools / "pkgs").iterdir())
