#!/usr/bin/env python3
"""Renders the tessera Helm chart for default and non-default values and checks the Kubernetes
fields that matter (kinds, names, selectors matching pod labels, ports, probe paths, volumes,
secret references), without a helm binary.

The renderer covers exactly the template subset the chart uses: `{{ .Values.a.b }}`,
`{{ .Release.Name }}`, `{{ .Chart.AppVersion }}`, `{{- if X }}`/`{{- else }}`/`{{- end }}` with
`not`, and the pipeline functions `quote`, `default`, `toYaml`, `nindent`, `indent`, with Go
template whitespace trimming (`{{-`, `-}}`). Anything else is an error, so a template that grows
past the subset fails here rather than rendering wrongly. A missing `.Values` key is an error
too (Helm would render it empty), which catches typos.

Run: python3 helm/test_chart.py  (needs PyYAML: the python3-yaml Debian package)
"""

import copy
import json
import re
import sys
import unittest
from pathlib import Path

try:
    import yaml
except ImportError:  # Fail loudly: the Makefile installs python3-yaml.
    sys.exit("error: helm/test_chart.py needs PyYAML (apt-get install -y python3-yaml)")

CHART = Path(__file__).resolve().parent / "tessera"
ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


class TemplateError(Exception):
    pass


def tokenize(text):
    """Text and action tokens, with `{{-`/`-}}` whitespace trimming applied."""
    tokens = []
    pos = 0
    trim_next = False
    for m in ACTION.finditer(text):
        chunk = text[pos : m.start()]
        if trim_next:
            chunk = chunk.lstrip()
        if m.group(1):
            chunk = chunk.rstrip()
        tokens.append(("text", chunk))
        tokens.append(("action", m.group(2)))
        trim_next = bool(m.group(3))
        pos = m.end()
    chunk = text[pos:]
    tokens.append(("text", chunk.lstrip() if trim_next else chunk))
    return tokens


def parse(tokens):
    """A tree of ("text", s), ("expr", s) and ("if", cond, then, else) nodes."""
    root = []
    stack = [(root, None)]
    for kind, value in tokens:
        body = stack[-1][0]
        if kind == "text":
            body.append(("text", value))
        elif value.startswith("if "):
            node = ["if", value[3:].strip(), [], []]
            body.append(node)
            stack.append((node[2], node))
        elif value == "else":
            node = stack[-1][1]
            if node is None:
                raise TemplateError("else outside if")
            stack[-1] = (node[3], node)
        elif value == "end":
            if len(stack) == 1:
                raise TemplateError("end without if")
            stack.pop()
        elif value.startswith("/*"):
            continue
        else:
            body.append(("expr", value))
    if len(stack) != 1:
        raise TemplateError("if without end")
    return root


def truthy(v):
    return v not in (None, False, 0, "", [], {})


def split_args(text):
    return re.findall(r'"(?:[^"\\]|\\.)*"|\S+', text)


class Context:
    def __init__(self, values, release, chart):
        self.root = {"Values": values, "Release": release, "Chart": chart}

    def term(self, t):
        if t.startswith('"'):
            return json.loads(t)
        if re.fullmatch(r"-?\d+", t):
            return int(t)
        if t in ("true", "false"):
            return t == "true"
        if t.startswith("."):
            value = self.root
            for part in t[1:].split("."):
                if not isinstance(value, dict) or part not in value:
                    raise TemplateError(f"{t}: no such value")
                value = value[part]
            return value
        raise TemplateError(f"unsupported term {t!r}")

    def call(self, name, args):
        if name == "quote":
            (v,) = args
            return json.dumps(render_scalar(v))
        if name == "default":
            fallback, v = args
            return v if truthy(v) else fallback
        if name == "toYaml":
            (v,) = args
            return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n")
        if name in ("nindent", "indent"):
            n, v = args
            pad = " " * n
            out = "\n".join(pad + line for line in str(v).split("\n"))
            return "\n" + out if name == "nindent" else out
        if name == "not":
            (v,) = args
            return not truthy(v)
        raise TemplateError(f"unsupported function {name!r}")

    def pipeline(self, text):
        value = None
        for i, command in enumerate(part.strip() for part in text.split("|")):
            words = split_args(command)
            if not words:
                raise TemplateError(f"empty command in {text!r}")
            head, rest = words[0], [self.term(w) for w in words[1:]]
            if i > 0:
                rest.append(value)
            if head.startswith(".") or head.startswith('"') or re.fullmatch(r"-?\d+", head):
                if rest:
                    raise TemplateError(f"{head} takes no arguments")
                value = self.term(head)
            else:
                value = self.call(head, rest)
        return value


def render_scalar(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return ""
    if isinstance(v, (dict, list)):
        raise TemplateError(f"a map or list printed as a scalar: {v!r}")
    return str(v)


def render_tree(nodes, ctx):
    out = []
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "expr":
            out.append(render_scalar(ctx.pipeline(node[1])))
        else:
            _, cond, then, other = node
            out.append(render_tree(then if truthy(ctx.pipeline(cond)) else other, ctx))
    return "".join(out)


def merge(base, overrides):
    out = copy.deepcopy(base)
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and v:
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def render_chart(overrides=None, release="demo"):
    """{template name: [documents]} for the chart with `overrides` merged into values.yaml."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = merge(yaml.safe_load((CHART / "values.yaml").read_text()), overrides or {})
    ctx = Context(
        values,
        {"Name": release, "Namespace": "default", "Service": "Helm"},
        {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]},
    )
    rendered = {}
    for path in sorted((CHART / "templates").glob("*.yaml")):
        text = render_tree(parse(tokenize(path.read_text())), ctx)
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
        rendered[path.name] = docs
    return rendered


def by_kind(rendered):
    out = {}
    for docs in rendered.values():
        for d in docs:
            out.setdefault(d["kind"], []).append(d)
    return out


class Renderer(unittest.TestCase):
    def test_trimming_conditions_and_pipelines(self):
        ctx = Context({"a": {"b": ""}, "n": 3, "m": {"k": "v"}}, {"Name": "r"}, {})
        tpl = 'x:\n  {{- if .Values.a.b }}\n  b: 1\n  {{- else }}\n  b: {{ .Values.a.b | default "d" | quote }}\n  {{- end }}\n  m:\n    {{- toYaml .Values.m | nindent 4 }}\n  n: {{ .Values.n }}\n'
        self.assertEqual(
            render_tree(parse(tokenize(tpl)), ctx), 'x:\n  b: "d"\n  m:\n    k: v\n  n: 3\n'
        )

    def test_unknown_values_and_constructs_are_errors(self):
        ctx = Context({}, {"Name": "r"}, {})
        for tpl in ["{{ .Values.nope }}", "{{ include \"x\" . }}", "{{ range .Values }}{{ end }}"]:
            with self.assertRaises(TemplateError, msg=tpl):
                render_tree(parse(tokenize(tpl)), ctx)


class Chart(unittest.TestCase):
    def check_common(self, rendered, release):
        kinds = by_kind(rendered)
        for docs in rendered.values():
            for d in docs:
                self.assertIn("apiVersion", d)
                self.assertIn("kind", d)
                self.assertEqual(d["metadata"]["name"], f"{release}-tessera")
        (deploy,) = kinds["Deployment"]
        (service,) = kinds["Service"]
        (config,) = kinds["ConfigMap"]
        self.assertEqual(deploy["apiVersion"], "apps/v1")
        pod = deploy["spec"]["template"]
        pod_labels = pod["metadata"]["labels"]
        selector = deploy["spec"]["selector"]["matchLabels"]
        self.assertTrue(selector and selector.items() <= pod_labels.items(), (selector, pod_labels))
        self.assertTrue(service["spec"]["selector"].items() <= pod_labels.items())
        (container,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        self.assertIn(service["spec"]["ports"][0]["targetPort"], ports)
        self.assertIsInstance(ports["http"], int)
        self.assertIn(f"--addr 0.0.0.0:{ports['http']}", container["args"][0])
        self.assertEqual(container["livenessProbe"]["httpGet"], {"path": "/healthz", "port": "http"})
        self.assertEqual(container["readinessProbe"]["httpGet"], {"path": "/readyz", "port": "http"})
        self.assertIn("requests", container["resources"])
        self.assertTrue(container["image"].startswith("ghcr.io/tessera/tessera:"))
        refs = container["envFrom"]
        self.assertEqual(refs[0]["configMapRef"]["name"], config["metadata"]["name"])
        for key in ["TESSERA_ROOT", "TESSERA_METADATA_CACHE_MIB", "TESSERA_PLAN_CACHE_MIB"]:
            self.assertIsInstance(config["data"][key], str, key)
            self.assertIn("$" + key, container["args"][0])
        return kinds, deploy, service, config, container

    def test_defaults(self):
        rendered = render_chart()
        kinds, deploy, service, config, container = self.check_common(rendered, "demo")
        self.assertEqual(sorted(kinds), ["ConfigMap", "Deployment", "Secret", "Service"])
        self.assertEqual(config["data"]["TESSERA_ROOT"], "s3://checkpoints/runs")
        self.assertEqual(config["data"]["TESSERA_METADATA_CACHE_MIB"], "1024")
        self.assertEqual(service["spec"]["ports"][0]["port"], 80)
        (secret,) = kinds["Secret"]
        self.assertFalse(secret.get("stringData"), "no token and no credentials by default")
        self.assertEqual(container["envFrom"][1]["secretRef"]["name"], secret["metadata"]["name"])
        self.assertNotIn("volumes", deploy["spec"]["template"]["spec"])
        self.assertNotIn("volumeMounts", container)

    def test_everything_enabled(self):
        rendered = render_chart(
            {
                "root": "",
                "token": "s3cret",
                "containerPort": 9090,
                "service": {"type": "NodePort", "port": 8081},
                "objectStoreCredentials": {"AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "x"},
                "persistence": {"enabled": True, "storageClass": "fast", "size": "5Gi"},
                "serviceMonitor": {"enabled": True},
                "podAnnotations": {"prometheus.io/scrape": "true"},
                "nodeSelector": {"pool": "cpu"},
                "config": {"corsOrigin": "https://ui.example"},
            },
            release="prod",
        )
        kinds, deploy, service, config, container = self.check_common(rendered, "prod")
        self.assertEqual(
            sorted(kinds),
            ["ConfigMap", "Deployment", "PersistentVolumeClaim", "Secret", "Service", "ServiceMonitor"],
        )
        self.assertEqual(container["ports"][0]["containerPort"], 9090)
        self.assertEqual(service["spec"]["type"], "NodePort")
        (secret,) = kinds["Secret"]
        self.assertEqual(
            secret["stringData"],
            {"TESSERA_TOKEN": "s3cret", "AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "x"},
        )
        (pvc,) = kinds["PersistentVolumeClaim"]
        self.assertEqual(pvc["spec"]["storageClassName"], "fast")
        self.assertEqual(pvc["spec"]["resources"]["requests"]["storage"], "5Gi")
        pod = deploy["spec"]["template"]["spec"]
        (volume,) = pod["volumes"]
        self.assertEqual(volume["persistentVolumeClaim"]["claimName"], pvc["metadata"]["name"])
        (mount,) = container["volumeMounts"]
        self.assertEqual(mount["name"], volume["name"])
        self.assertEqual(config["data"]["TESSERA_ROOT"], mount["mountPath"])
        self.assertEqual(config["data"]["TESSERA_CORS_ORIGIN"], "https://ui.example")
        self.assertEqual(pod["nodeSelector"], {"pool": "cpu"})
        self.assertEqual(deploy["spec"]["template"]["metadata"]["annotations"], {"prometheus.io/scrape": "true"})
        (monitor,) = kinds["ServiceMonitor"]
        self.assertTrue(monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items())
        (endpoint,) = monitor["spec"]["endpoints"]
        self.assertEqual((endpoint["port"], endpoint["path"]), ("http", "/metrics"))
        self.assertEqual(endpoint["port"], service["spec"]["ports"][0]["name"])
        # /metrics needs the token: the scrapes send it from the chart's Secret.
        self.assertEqual(
            endpoint["authorization"],
            {"type": "Bearer", "credentials": {"name": secret["metadata"]["name"], "key": "TESSERA_TOKEN"}},
        )

    def test_service_monitor_without_a_token_sends_none(self):
        rendered = render_chart({"serviceMonitor": {"enabled": True}})
        kinds, _, _, _, _ = self.check_common(rendered, "demo")
        (monitor,) = kinds["ServiceMonitor"]
        (endpoint,) = monitor["spec"]["endpoints"]
        self.assertNotIn("authorization", endpoint)

    def test_existing_secret(self):
        rendered = render_chart(
            {"existingSecret": "tessera-creds", "token": "ignored", "serviceMonitor": {"enabled": True}}
        )
        kinds, _, _, _, container = self.check_common(rendered, "demo")
        self.assertNotIn("Secret", kinds)
        self.assertEqual(container["envFrom"][1]["secretRef"]["name"], "tessera-creds")
        (monitor,) = kinds["ServiceMonitor"]
        (endpoint,) = monitor["spec"]["endpoints"]
        self.assertEqual(
            endpoint["authorization"]["credentials"],
            {"name": "tessera-creds", "key": "TESSERA_TOKEN", "optional": True},
        )


class Dockerfile(unittest.TestCase):
    def test_multi_stage_build_runs_the_server(self):
        text = (CHART.parent.parent / "Dockerfile").read_text()
        stages = re.findall(r"^FROM\s+\S+(?:\s+AS\s+(\S+))?", text, re.M | re.I)
        self.assertGreaterEqual(len(stages), 2, "a build stage and a runtime stage")
        self.assertRegex(text, r"COPY --from=" + stages[0] + r"\b")
        self.assertRegex(text, r"cargo build --release --locked")
        self.assertRegex(text, r"USER 65532")
        self.assertIn("EXPOSE 8080", text)


if __name__ == "__main__":
    unittest.main(verbosity=2)
