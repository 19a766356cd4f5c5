#!/usr/bin/python3
"""check-meta.py: check a META.json against the PGXN Meta Spec 1.0.0, and
check that every place naming the release version agrees with it.

usage: scripts/check-meta.py [--tree DIR] META.json

Without --tree only the file is checked: the keys the spec requires, the type
and form of every key it defines (SemVer versions, version ranges, licence
names, URLs), and that any other key is a custom one (x_ or X_). With --tree,
the distribution in DIR must also agree with it: the files `provides` names
exist, the control file's default_version is the version's major.minor, and
the install script of that version, the library's IDEM_VERSION, the top entry
of CHANGELOG.md, debian/changelog's upstream version, the package and zip names
and the library version in the install steps (docs/install/self-hosted.md),
the library version the update steps show (docs/upgrading.md) and the newest
version of the SQL edition (sql-edition/versions) all name the version.

Prints each problem on its own line and exits 1 if there is any, 0 otherwise.
Uses the standard library only (PGXN's own validator is not packaged here).
"""

import json
import os
import re
import sys

SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?$")
# A version range: "0" (any), a version, or comparisons joined by commas.
RANGE_PART = re.compile(r"^\s*(?:(?:==|!=|>=|<=|>|<)\s*)?(\S+)\s*$")
# A term (distribution and extension names, tags): no whitespace, slash,
# backslash or colon, at least two characters.
TERM = re.compile(r"^[^\s/\\:]{2,}$")
URL = re.compile(r"^[a-z][a-z0-9+.-]*://\S+$", re.IGNORECASE)
LICENSES = {
    "agpl_3", "apache_1_1", "apache_2_0", "artistic_1", "artistic_2", "bsd",
    "freebsd", "gfdl_1_2", "gfdl_1_3", "gpl_1", "gpl_2", "gpl_3", "lgpl_2_1",
    "lgpl_3_0", "mit", "mozilla_1_0", "mozilla_1_1", "openssl", "perl_5",
    "postgresql", "qpl_1_0", "ssleay", "sun", "zlib", "open_source",
    "restricted", "unrestricted", "unknown",
}
PHASES = {"configure", "build", "test", "runtime", "develop"}
RELATIONS = {"requires", "recommends", "suggests", "conflicts"}
TOP_KEYS = {
    "name", "version", "abstract", "maintainer", "license", "provides",
    "meta-spec", "description", "generated_by", "tags", "no_index", "prereqs",
    "release_status", "resources",
}


class Problems(list):
    """The problems found, each a line of text."""

    def need(self, ok, text):
        if not ok:
            self.append(text)
        return ok


def custom(key):
    """Keys the spec leaves to the author."""
    return key[:2] in ("x_", "X_")


def string(value, min_len=1):
    return isinstance(value, str) and len(value) >= min_len


def check_version_range(p, where, value):
    if p.need(isinstance(value, str), f"{where}: a version range is a string"):
        if value.strip() == "0":
            return
        for part in value.split(","):
            m = RANGE_PART.match(part)
            p.need(m and (SEMVER.match(m.group(1)) or m.group(1) == "0"),
                   f"{where}: {part.strip()!r} is not a SemVer version or comparison")


def check_keys(p, where, obj, allowed):
    for key in obj:
        p.need(key in allowed or custom(key), f"{where}: unknown key {key!r}")


def check_meta(meta):
    """Return the problems of one META.json document against the spec."""
    p = Problems()
    if not p.need(isinstance(meta, dict), "META.json is not a JSON object"):
        return p
    for key in ("name", "version", "abstract", "maintainer", "license",
                "provides", "meta-spec"):
        p.need(key in meta, f"required key {key!r} is missing")
    check_keys(p, "top level", meta, TOP_KEYS)

    if "name" in meta:
        p.need(string(meta["name"]) and TERM.match(meta["name"]),
               "name: a term of two or more characters, no space, '/', '\\' or ':'")
    if "version" in meta:
        p.need(string(meta["version"]) and SEMVER.match(meta["version"]),
               f"version: {meta['version']!r} is not a SemVer version")
    for key in ("abstract", "description", "generated_by"):
        if key in meta:
            p.need(string(meta[key]), f"{key}: a non-empty string")
    if "maintainer" in meta:
        m = meta["maintainer"]
        p.need(string(m) or (isinstance(m, list) and m and all(string(x) for x in m)),
               "maintainer: a string or a non-empty list of strings")
    if "license" in meta:
        lic = meta["license"]
        if isinstance(lic, str):
            p.need(lic in LICENSES, f"license: {lic!r} is not a licence the spec names")
        elif isinstance(lic, list):
            p.need(lic and all(x in LICENSES for x in lic),
                   "license: every name in the list must be one the spec names")
        elif isinstance(lic, dict):
            p.need(lic and all(string(k) and string(v) and URL.match(v)
                               for k, v in lic.items()),
                   "license: a map of licence names to URLs")
        else:
            p.append("license: a string, a list or a map")
    if "provides" in meta:
        prov = meta["provides"]
        if p.need(isinstance(prov, dict) and prov, "provides: a non-empty map"):
            for ext, info in prov.items():
                where = f"provides.{ext}"
                p.need(TERM.match(ext), f"{where}: the extension name is not a term")
                if not p.need(isinstance(info, dict), f"{where}: a map"):
                    continue
                check_keys(p, where, info, {"file", "version", "abstract", "docfile"})
                p.need(string(info.get("file")), f"{where}.file: required, a path")
                p.need(string(info.get("version")) and SEMVER.match(info["version"]),
                       f"{where}.version: required, a SemVer version")
                for key in ("abstract", "docfile"):
                    if key in info:
                        p.need(string(info[key]), f"{where}.{key}: a non-empty string")
    if "meta-spec" in meta:
        spec = meta["meta-spec"]
        if p.need(isinstance(spec, dict), "meta-spec: a map"):
            check_keys(p, "meta-spec", spec, {"version", "url"})
            p.need(spec.get("version") == "1.0.0", "meta-spec.version: 1.0.0")
            if "url" in spec:
                p.need(string(spec["url"]) and URL.match(spec["url"]), "meta-spec.url: a URL")
    if "tags" in meta:
        tags = meta["tags"]
        p.need(isinstance(tags, list) and tags
               and all(string(t) and len(t) <= 255 for t in tags),
               "tags: a non-empty list of strings of at most 255 characters")
    if "no_index" in meta:
        ni = meta["no_index"]
        if p.need(isinstance(ni, dict), "no_index: a map"):
            check_keys(p, "no_index", ni, {"file", "directory"})
            for key, value in ni.items():
                p.need(isinstance(value, list) and all(string(v) for v in value),
                       f"no_index.{key}: a list of paths")
    if "prereqs" in meta:
        pre = meta["prereqs"]
        if p.need(isinstance(pre, dict), "prereqs: a map"):
            check_keys(p, "prereqs", pre, PHASES)
            for phase, rels in pre.items():
                if not p.need(isinstance(rels, dict), f"prereqs.{phase}: a map"):
                    continue
                check_keys(p, f"prereqs.{phase}", rels, RELATIONS)
                for rel, deps in rels.items():
                    where = f"prereqs.{phase}.{rel}"
                    if p.need(isinstance(deps, dict), f"{where}: a map"):
                        for name, rng in deps.items():
                            check_version_range(p, f"{where}.{name}", rng)
    if "release_status" in meta:
        p.need(meta["release_status"] in ("stable", "testing", "unstable"),
               "release_status: stable, testing or unstable")
    if "resources" in meta:
        res = meta["resources"]
        if p.need(isinstance(res, dict), "resources: a map"):
            check_keys(p, "resources", res, {"homepage", "bugtracker", "repository"})
            if "homepage" in res:
                p.need(string(res["homepage"]) and URL.match(res["homepage"]),
                       "resources.homepage: a URL")
            bt = res.get("bugtracker", {})
            if p.need(isinstance(bt, dict), "resources.bugtracker: a map"):
                check_keys(p, "resources.bugtracker", bt, {"web", "mailto"})
                if "web" in bt:
                    p.need(URL.match(str(bt["web"])), "resources.bugtracker.web: a URL")
                if "mailto" in bt:
                    p.need("@" in str(bt["mailto"]), "resources.bugtracker.mailto: an address")
            repo = res.get("repository", {})
            if p.need(isinstance(repo, dict), "resources.repository: a map"):
                check_keys(p, "resources.repository", repo, {"url", "web", "type"})
                for key in ("url", "web"):
                    if key in repo:
                        p.need(URL.match(str(repo[key])), f"resources.repository.{key}: a URL")
                if "type" in repo:
                    p.need(string(repo["type"]) and repo["type"].islower(),
                           "resources.repository.type: a lower-case name (git, svn, ...)")
    return p


def read(tree, path):
    with open(os.path.join(tree, path), encoding="utf-8") as f:
        return f.read()


def check_tree(meta, tree):
    """Return the problems of the distribution in <tree> against its META."""
    p = Problems()
    version = meta.get("version", "")
    major_minor = ".".join(version.split(".")[:2])
    for ext, info in meta.get("provides", {}).items():
        for key in ("file", "docfile"):
            if key in info:
                p.need(os.path.isfile(os.path.join(tree, info[key])),
                       f"provides.{ext}.{key}: {info[key]} is not in the distribution")
        p.need(info.get("version") == version,
               f"provides.{ext}.version {info.get('version')!r} is not the release's {version!r}")

    control = read(tree, "idempotency.control")
    m = re.search(r"^default_version\s*=\s*'([^']*)'", control, re.M)
    p.need(m and m.group(1) == major_minor,
           f"idempotency.control: default_version is {m and m.group(1)!r}, "
           f"the release {version} needs {major_minor!r}")
    p.need(os.path.isfile(os.path.join(tree, f"idempotency--{major_minor}.sql")),
           f"idempotency--{major_minor}.sql (the install script of {major_minor}) is missing")

    m = re.search(r'#define\s+IDEM_VERSION\s+"([^"]*)"', read(tree, "src/idempotency.h"))
    p.need(m and m.group(1) == version,
           f"src/idempotency.h: IDEM_VERSION is {m and m.group(1)!r}, not {version!r}")

    m = re.search(r"^## (\S+)", read(tree, "CHANGELOG.md"), re.M)
    p.need(m and m.group(1) == version,
           f"CHANGELOG.md: the top entry is {m and m.group(1)!r}, not {version!r}")

    m = re.match(r"^(\S+) \(([^)-]+)(?:-[^)]*)?\)", read(tree, "debian/changelog"))
    p.need(m and m.group(2) == version,
           f"debian/changelog: the upstream version is {m and m.group(2)!r}, not {version!r}")

    # The install and update steps name the release.
    for doc, pattern in (
            ("docs/install/self-hosted.md", r"idempotency_([0-9][^-_ ]*)-\d+_amd64\.deb"),
            ("docs/install/self-hosted.md", r"idempotency-([0-9][0-9.]*[0-9])\.zip"),
            ("docs/install/self-hosted.md", r"idem_version\(\);\n--  (\S+)"),
            ("docs/upgrading.md", r"-- (\S+) once the new library runs")):
        if os.path.isfile(os.path.join(tree, doc)):
            for named in re.findall(pattern, read(tree, doc)):
                p.need(named == version, f"{doc}: names release {named}, not {version}")

    # The SQL edition's newest version is the release (scripts/sql-edition.sh).
    if os.path.isfile(os.path.join(tree, "sql-edition/versions")):
        versions = [line.strip() for line in read(tree, "sql-edition/versions").splitlines()
                    if line.strip() and not line.strip().startswith("#")]
        p.need(versions and (versions[-1] == version
                             or (len(versions) == 1 and versions[0] == major_minor)),
               f"sql-edition/versions: the newest is {versions[-1] if versions else None!r}, "
               f"not the release {version!r}")
    return p


def main(argv):
    tree = None
    if len(argv) == 4 and argv[1] == "--tree":
        tree, path = argv[2], argv[3]
    elif len(argv) == 2:
        path = argv[1]
    else:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        print(f"{path}: {e}")
        return 1
    problems = check_meta(meta)
    if tree is not None and not problems:
        try:
            problems = check_tree(meta, tree)
        except OSError as e:
            problems = [str(e)]
    for line in problems:
        print(f"{path}: {line}")
    if not problems:
        print(f"{path}: valid PGXN Meta Spec 1.0.0"
              + (f"; {tree} agrees with version {meta['version']}" if tree else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
