"""Policy files: from YAML on disk to a compiled matcher the resolver asks per query.

```
 policies/*.yaml
     │  loader: read ≤ 1 MiB, decode UTF-8                       (the only I/O here)
     ▼
 tree.compose: YAML events ─▶ positioned tree (file:line:col on every node;
     │         duplicate keys, alias bombs, deep nesting refused)
     ▼
 validate / dnsspec / ports / values / names / rrtypes:
     │         tree ─▶ egress.model.Policy, or PolicyError with EVERY problem
     ▼
 matcher.Matcher(policy).decide(name, qtype) ─▶ Decision   (resolver, egressctl check)
 schema.policy_json_schema()                               (editors, egressctl schema)
```

Nothing here opens sockets or starts processes: this is the pure core (see DESIGN.md).
The public entry points are re-exported below; ``names.normalize_name`` is the one
spelling of a DNS name shared by policies and the resolver.
"""

from __future__ import annotations

from egress.policy.loader import load_policy, load_policy_with_warnings, parse_policy
from egress.policy.matcher import Decision, Matcher

__all__ = ["Decision", "Matcher", "load_policy", "load_policy_with_warnings", "parse_policy"]
