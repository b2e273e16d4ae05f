#!/usr/bin/env bash
# Joins a bundle made by `python bench/carry.py prepare NAME ...`, one carried part per device call.
#
#   bash bench/carry_assemble.sh NAME PART_DIR [DEST]   # e.g. graph .carry/graph/part-000
#   bash bench/carry_assemble.sh --status NAME [DEST]   # which parts are here / still needed
#
# Run from the repo root on the device. DEST defaults to /tmp/carry/NAME (it survives between calls
# while the machine stays warm). Each call checks its part's sha256 against the manifest and keeps it in
# DEST/parts/; a part already there is a no-op, so calls can be repeated or come in any order. Once
# every part is there it joins them, checks the archive's sha256, extracts DEST/wheels/*.whl and
# DEST/files/* (extra files, sha256-checked), runs
#   python3 -m pip install --no-index --no-deps --target DEST/site DEST/wheels/*.whl
# and prints READY and the PYTHONPATH to use. If the machine was lost, /tmp is empty again and the
# script lists the parts still needed. PYTHON=... picks the interpreter (default python3).
set -euo pipefail
PY=${PYTHON:-python3}
usage() { sed -n '2,5p' "$0" >&2; exit 2; }

status=0
if [[ ${1:-} == --status ]]; then status=1; shift; fi
[[ $# -ge 1 ]] || usage
name=$1
if (( status )); then dest=${2:-/tmp/carry/$name}; part_dir=""; else
  [[ $# -ge 2 ]] || usage; part_dir=$2; dest=${3:-/tmp/carry/$name}; fi
mkdir -p "$dest/parts"

# Manifest helper: prints fields of DEST/manifest.json (or of the file given as $2).
mf() { "$PY" - "$1" "${2:-$dest/manifest.json}" <<'EOF'
import json, sys
what, path = sys.argv[1], sys.argv[2]
m = json.load(open(path))
if what == "sha": print(m["archive_sha256"])
elif what == "parts":
    for p in m["parts"]: print(p["dir"], p["name"], p["sha256"], p["size"])
elif what == "files":
    for x in m["members"]:
        if x["path"].startswith("files/"): print(f'{x["sha256"]}  {x["path"]}')
elif what == "compression": print(m["compression"])
elif what == "archive": print(m["archive"])
EOF
}
ready_msg() {
  echo "READY $name: $(ls "$dest"/wheels | wc -l) wheels in $dest/site, files in $dest/files/"
  echo "export PYTHONPATH=$dest/site\${PYTHONPATH:+:\$PYTHONPATH}   # console scripts: $dest/site/bin"
}

if [[ -n $part_dir ]]; then
  [[ -f $part_dir/manifest.json ]] || { echo "no manifest.json in $part_dir" >&2; exit 2; }
  new_sha=$(mf sha "$part_dir/manifest.json")
  if [[ -f $dest/manifest.json && $(mf sha) != "$new_sha" ]]; then
    echo "bundle $name changed (archive sha differs): starting $dest afresh"
    rm -rf "$dest"; mkdir -p "$dest/parts"
  fi
  [[ -f $dest/manifest.json ]] || cp "$part_dir/manifest.json" "$dest/manifest.json"
fi
[[ -f $dest/manifest.json ]] || { echo "nothing of $name in $dest yet: carry any part"; exit 0; }
if [[ -f $dest/READY && $(cat "$dest/READY") == "$(mf sha)" ]]; then ready_msg; exit 0; fi

# Take in whatever part(s) this call carried.
missing=()
while read -r dir file sha size; do
  have=$dest/parts/$file
  if [[ -f $have.ok ]]; then
    [[ -n $part_dir && -f $part_dir/$file ]] && echo "$dir: already here"
  elif [[ -n $part_dir && -f $part_dir/$file ]]; then
    cp "$part_dir/$file" "$have.tmp"
    got=$(sha256sum "$have.tmp" | cut -d' ' -f1)
    if [[ $got != "$sha" ]]; then rm -f "$have.tmp"; echo "$dir: sha256 MISMATCH ($got), not kept" >&2; exit 1; fi
    mv "$have.tmp" "$have"; touch "$have.ok"; echo "$dir: stored ($size bytes, sha256 ok)"
  fi
  [[ -f $have.ok ]] || missing+=("$dir")
done < <(mf parts)

total=$(mf parts | wc -l)
if (( status )); then
  while read -r dir file _; do
    [[ -f $dest/parts/$file.ok ]] && echo "present  $dir" || echo "missing  $dir"; done < <(mf parts)
fi
if (( ${#missing[@]} )); then
  echo "$name: $(( total - ${#missing[@]} ))/$total parts here; still needed: ${missing[*]}"
  for d in "${missing[@]}"; do echo "  carry .carry/$name/$d and run: bash bench/carry_assemble.sh $name .carry/$name/$d"; done
  exit 0
fi
(( status )) && { echo "$name: all $total parts here, not yet assembled (run with any part dir)"; exit 0; }

# All parts here: join, verify, extract, install.
archive=$dest/$(mf archive)
mf parts | while read -r _ file _; do cat "$dest/parts/$file"; done > "$archive"
got=$(sha256sum "$archive" | cut -d' ' -f1)
if [[ $got != "$(mf sha)" ]]; then
  rm -f "$archive" "$dest"/parts/*.ok; echo "joined archive sha256 MISMATCH: parts dropped, carry them again" >&2; exit 1
fi
rm -rf "$dest/wheels" "$dest/files" "$dest/site" "$dest/site.tmp" "$dest/x.tmp"
mkdir -p "$dest/x.tmp"
"$PY" - "$archive" "$dest/x.tmp" <<'EOF'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:*") as t:
    t.extractall(sys.argv[2], filter="data") if hasattr(tarfile, "data_filter") else t.extractall(sys.argv[2])
EOF
if [[ -n $(mf files) ]]; then
  (cd "$dest/x.tmp" && mf files "$dest/manifest.json" | sha256sum --quiet -c -) \
    || { echo "extra file sha256 MISMATCH" >&2; exit 1; }
fi
mkdir -p "$dest/x.tmp/files" "$dest/x.tmp/wheels"
mv "$dest/x.tmp/wheels" "$dest/x.tmp/files" "$dest/"; rmdir "$dest/x.tmp"; rm -f "$archive"
"$PY" -c 'import sys; v=sys.version_info[:2]; (v != (3, 12)) and print(f"WARNING: python {v[0]}.{v[1]}; the wheels are for 3.12")'
PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --disable-pip-version-check --no-warn-script-location --no-index --no-deps \
  --target "$dest/site.tmp" "$dest"/wheels/*.whl
mv "$dest/site.tmp" "$dest/site"
mf sha > "$dest/READY"
ready_msg
