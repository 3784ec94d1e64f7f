"""Writes benign_extra.txt: the high-cardinality names real software resolves.

Generated from each service's documented host patterns (not recorded traffic): the ids
in them (buckets, distributions, accounts, project and org ids) are random stand-ins
with the real length and alphabet. Each task's hosts are asked in a Zipf-like order,
each name as A and AAAA (glibc), some as HTTPS. Run from the repo root:

    python3 tests/data/make_benign_extra.py > tests/data/benign_extra.txt
"""

import random

rng = random.Random(13)
AWS_REGIONS = [
    "us-east-1",
    "us-east-2",
    "us-west-1",
    "us-west-2",
    "af-south-1",
    "ap-east-1",
    "ap-south-1",
    "ap-south-2",
    "ap-southeast-1",
    "ap-southeast-2",
    "ap-southeast-3",
    "ap-southeast-4",
    "ap-northeast-1",
    "ap-northeast-2",
    "ap-northeast-3",
    "ca-central-1",
    "ca-west-1",
    "eu-central-1",
    "eu-central-2",
    "eu-west-1",
    "eu-west-2",
    "eu-west-3",
    "eu-south-1",
    "eu-south-2",
    "eu-north-1",
    "il-central-1",
    "me-south-1",
    "me-central-1",
    "sa-east-1",
]
AWS_SERVICES = [
    "ec2",
    "sts",
    "s3",
    "lambda",
    "logs",
    "monitoring",
    "dynamodb",
    "sqs",
    "sns",
    "ecr",
    "api.ecr",
    "ecs",
    "eks",
    "kms",
    "secretsmanager",
    "ssm",
    "bedrock-runtime",
    "bedrock",
    "cloudformation",
    "elasticloadbalancing",
    "autoscaling",
    "rds",
    "athena",
    "glue",
    "states",
    "events",
]
GCP_REGIONS = [
    "us-central1",
    "us-east1",
    "us-east4",
    "us-west1",
    "us-west2",
    "europe-west1",
    "europe-west2",
    "europe-west3",
    "europe-west4",
    "asia-east1",
    "asia-northeast1",
    "asia-southeast1",
    "australia-southeast1",
    "southamerica-east1",
    "northamerica-northeast1",
]
AZURE_REGIONS = [
    "eastus",
    "eastus2",
    "westus",
    "westus2",
    "westus3",
    "centralus",
    "northeurope",
    "westeurope",
    "uksouth",
    "francecentral",
    "germanywestcentral",
    "japaneast",
    "southeastasia",
    "australiaeast",
]
LOWER = "abcdefghijklmnopqrstuvwxyz"
ALNUM = LOWER + "0123456789"


def rand(alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def bucket() -> str:
    words = [
        "assets",
        "artifacts",
        "backups",
        "build",
        "cache",
        "data",
        "logs",
        "models",
        "releases",
        "static",
        "uploads",
        "terraform-state",
        "ml-datasets",
        "ci",
    ]
    return f"{rng.choice(['acme', 'corp', 'team', 'proj'])}-{rng.choice(words)}-{rand(ALNUM, 6)}"


def tasks() -> list[list[str]]:
    out = []
    # An AWS CLI / SDK agent touching many regions and services.
    out.append([f"{s}.{r}.amazonaws.com" for r in AWS_REGIONS for s in rng.sample(AWS_SERVICES, 6)])
    out.append([f"{s}.amazonaws.com" for s in ("sts", "iam", "organizations", "route53", "s3")])
    # Per-bucket S3, path and virtual-hosted, dualstack, regional.
    s3 = []
    for _ in range(60):
        b, r = bucket(), rng.choice(AWS_REGIONS)
        s3 += [f"{b}.s3.amazonaws.com", f"{b}.s3.{r}.amazonaws.com"]
        if rng.random() < 0.3:
            s3.append(f"{b}.s3.dualstack.{r}.amazonaws.com")
    out.append(s3)
    # CloudFront distributions and ELB/API Gateway endpoints.
    out.append([f"d{rand(ALNUM, 13)}.cloudfront.net" for _ in range(40)])
    out.append(
        [
            f"{rand(ALNUM, 10)}.execute-api.{rng.choice(AWS_REGIONS)}.amazonaws.com"
            for _ in range(15)
        ]
    )
    out.append(
        [f"{rand(ALNUM, 32)}.lambda-url.{rng.choice(AWS_REGIONS)}.on.aws" for _ in range(10)]
    )
    # Akamai edge hosts (tools that resolve the CNAME targets themselves: curl --resolve, Go).
    out.append(
        [f"e{rng.randint(1000, 99999)}.{rng.choice('abcdefg')}.akamaiedge.net" for _ in range(30)]
        + [f"a{rng.randint(100, 9999)}.dscg.akamai.net" for _ in range(15)]
    )
    # Azure: storage accounts, web apps, regional management endpoints.
    out.append(
        [f"{rand(LOWER + '0123456789', 14)}.blob.core.windows.net" for _ in range(30)]
        + [f"{rand(LOWER, 10)}.azurewebsites.net" for _ in range(15)]
        + [f"{r}.management.azure.com" for r in AZURE_REGIONS]
        + [f"{r}.api.cognitive.microsoft.com" for r in AZURE_REGIONS]
        + ["login.microsoftonline.com", "management.azure.com", "graph.microsoft.com"]
    )
    # GCS buckets and GCP regional endpoints, Artifact Registry per region.
    out.append(
        [f"{bucket()}.storage.googleapis.com" for _ in range(30)]
        + [f"{r}-aiplatform.googleapis.com" for r in GCP_REGIONS]
        + [f"{r}-docker.pkg.dev" for r in GCP_REGIONS]
        + [f"{r}-python.pkg.dev" for r in GCP_REGIONS]
        + [f"{r}-run.googleapis.com" for r in GCP_REGIONS]
    )
    # Registries' file hosts.
    out.append(
        [
            "files.pythonhosted.org",
            "pypi.org",
            "registry.npmjs.org",
            "static.crates.io",
            "index.crates.io",
            "proxy.golang.org",
            "sum.golang.org",
            "storage.googleapis.com",
            "repo.maven.apache.org",
            "repo1.maven.org",
            "plugins.gradle.org",
            "services.gradle.org",
            "downloads.gradle.org",
            "rubygems.org",
            "index.rubygems.org",
            "production.cloudflare.docker.com",
            "registry-1.docker.io",
            "auth.docker.io",
            "ghcr.io",
            "pkg-containers.githubusercontent.com",
            "quay.io",
            "cdn01.quay.io",
            "cdn02.quay.io",
            "cdn03.quay.io",
            "deb.debian.org",
            "security.debian.org",
            "archive.ubuntu.com",
            "security.ubuntu.com",
            "dl-cdn.alpinelinux.org",
            "conda.anaconda.org",
            "repo.anaconda.com",
            "huggingface.co",
            "cdn-lfs.huggingface.co",
            "cdn-lfs-us-1.huggingface.co",
            "cas-bridge.xethub.hf.co",
            "download.pytorch.org",
            "nodejs.org",
            "yarnpkg.com",
            "registry.yarnpkg.com",
            "repo.packagist.org",
            "api.nuget.org",
            "globalcdn.nuget.org",
            "formulae.brew.sh",
            "ghcr.io",
        ]
    )
    # Telemetry and ingest hosts with org and project ids.
    out.append(
        [f"o{rng.randint(100000, 4999999)}.ingest.sentry.io" for _ in range(12)]
        + [f"o{rng.randint(100000, 4999999)}.ingest.us.sentry.io" for _ in range(12)]
        + [f"o{rng.randint(100000, 4999999)}.ingest.de.sentry.io" for _ in range(4)]
        + [
            "http-intake.logs.datadoghq.com",
            "browser-intake-datadoghq.com",
            "api.datadoghq.com",
            "trace.agent.datadoghq.com",
            "us5.datadoghq.com",
            "http-intake.logs.us5.datadoghq.com",
            "us.i.posthog.com",
            "eu.i.posthog.com",
            "api.honeycomb.io",
            "api.eu1.honeycomb.io",
            "in.logs.betterstack.com",
            "otlp.nr-data.net",
            "log-api.newrelic.com",
            "insights-collector.newrelic.com",
            "api.segment.io",
            "cdn.segment.com",
            "api.mixpanel.com",
            "api-js.mixpanel.com",
            "o.ss2.us",
            "collector.github.com",
        ]
        + [f"{rand(ALNUM, 20)}.otlp.{rng.choice(['us', 'eu'])}.grafana.net" for _ in range(3)]
    )
    # Git hosts' raw and archive hosts.
    out.append(
        [
            "raw.githubusercontent.com",
            "codeload.github.com",
            "objects.githubusercontent.com",
            "release-assets.githubusercontent.com",
            "github-releases.githubusercontent.com",
            "media.githubusercontent.com",
            "gitlab.com",
            "registry.gitlab.com",
            "gitlab-org.gitlab.io",
            "bitbucket.org",
            "bbuseruploads.s3.amazonaws.com",
            "api.bitbucket.org",
            "codeberg.org",
            "sr.ht",
            "git.sr.ht",
        ]
    )
    # NTP pools.
    out.append(
        [
            f"{i}.{p}pool.ntp.org"
            for p in (
                "",
                "debian.",
                "ubuntu.",
                "centos.",
                "fedora.",
                "android.",
                "amazon.",
                "opensuse.",
            )
            for i in range(4)
        ]
        + [f"time{i}.google.com" for i in range(1, 5)]
        + [
            "time.google.com",
            "time.cloudflare.com",
            "time.apple.com",
            "time.aws.com",
            "time.windows.com",
            "ntp.ubuntu.com",
        ]
    )
    # What `pip install` of 50 packages resolves (pip's index and file host, nothing per
    # package) and `npm install` of a large project (the registry, plus the download hosts
    # that popular install scripts document: sharp, electron, puppeteer, playwright,
    # cypress, prisma, node-gyp headers).
    out.append(["pypi.org", "files.pythonhosted.org"])
    out.append(
        [
            "registry.npmjs.org",
            "github.com",
            "objects.githubusercontent.com",
            "release-assets.githubusercontent.com",
            "storage.googleapis.com",
            "edgedl.me.gvt1.com",
            "playwright.azureedge.net",
            "cdn.playwright.dev",
            "playwright-akamai.azureedge.net",
            "playwright-verizon.azureedge.net",
            "download.cypress.io",
            "cdn.cypress.io",
            "binaries.prisma.sh",
            "nodejs.org",
            "unofficial-builds.nodejs.org",
        ]
    )
    return out


def main() -> None:
    print("# Benign high-cardinality names (tests/data/make_benign_extra.py; see its docstring).")
    for hosts in tasks():
        weights = [1 / (i + 1) for i in range(len(hosts))]
        order = list(hosts) + rng.choices(hosts, weights, k=len(hosts) // 2)
        rng.shuffle(order)
        for name in order:
            print(name)
            print(f"{name} AAAA")
            if rng.random() < 0.2:
                print(f"{name} HTTPS")


if __name__ == "__main__":
    main()
