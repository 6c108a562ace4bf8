#!/usr/bin/env bash
# On the development machine: a real model larger than one device call carries, cut into pieces
# that each fill what a call has room for beside the working tree (64 MiB in all), for calls
# that follow each other on one warm GPU machine:
#   scripts/gpu-pieces.sh MODEL.gguf [FIRST_ROOM]
# writes .bench/piece-1/ .. .bench/piece-N/ (an ignored folder), each holding its piece of the
# file compressed with zstd (`zstd -19 --long=27`: Q8_0 and K-quant files shrink by about 6%)
# and take.sh. Piece 1 may be made smaller (FIRST_ROOM bytes) to ride in a call that carries
# other things. Then, one call per piece, in order, each within the machine's idle time of the
# last:
#   run(command="bash .bench/piece-K/take.sh", carry=[".bench/piece-K"])
# take.sh copies its piece to /tmp/pieces; once all are there it joins them into
# /tmp/pieces/model.gguf and checks the sha256 this script printed. zstd travels with piece 1
# (the GPU machine's image may lack it: this machine's binary and library, run from /tmp).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODEL=${1:?usage: gpu-pieces.sh MODEL.gguf [FIRST_ROOM]}
cd "$ROOT"
grep -qx '/.bench/' .git/info/exclude 2>/dev/null || echo '/.bench/' >> .git/info/exclude
# What every call carries besides its piece: the tracked and untracked-not-ignored files.
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
margin=400000
room=$(( 64 * 1024 * 1024 - tree - margin ))
[ "$room" -gt 4000000 ] || { echo "the working tree ($tree bytes) leaves no room for pieces" >&2; exit 1; }
first=${2:-$room}
[ "$first" -le "$room" ] || first=$room
sha=$(sha256sum "$MODEL" | cut -d' ' -f1)
tmp=$(mktemp -d)
zstd -q -T0 -19 --long=27 -c "$MODEL" > "$tmp/model.zst"
rm -rf .bench/piece-*
# Piece 1 also carries zstd and its library (about 0.9 MB gzipped).
tools=$tmp/zstd.tgz
tar czf "$tools" -C "$(dirname "$(command -v zstd)")" zstd \
  -C "$(dirname "$(ldconfig -p | awk '/libzstd.so.1 /{print $NF; exit}')")" libzstd.so.1
first=$(( first - $(stat -c %s "$tools") - 4096 ))
total=$(stat -c %s "$tmp/model.zst")
head -c "$first" "$tmp/model.zst" > "$tmp/part.1"
tail -c +$(( first + 1 )) "$tmp/model.zst" | split -b "$room" -d -a 2 - "$tmp/rest."
n=1
for f in "$tmp"/rest.*; do n=$(( n + 1 )); mv "$f" "$tmp/part.$n"; done
for k in $(seq 1 "$n"); do
  d=.bench/piece-$k
  mkdir -p "$d"
  mv "$tmp/part.$k" "$d/part.$(printf %02d "$k")"
  cat > "$d/take.sh" <<EOF
#!/usr/bin/env bash
# Piece $k of $n of $(basename "$MODEL") (sha256 $sha), written by scripts/gpu-pieces.sh.
set -euo pipefail
P=/tmp/pieces; mkdir -p \$P
cd "\$(dirname "\$0")"
[ ! -f zstd.tgz ] || tar xzf zstd.tgz -C \$P
cp part.* \$P/
have=\$(ls \$P/part.* | wc -l); echo "pieces at \$P: \$have of $n"
if [ "\$have" -eq $n ]; then
  Z=zstd; command -v zstd > /dev/null || Z="env LD_LIBRARY_PATH=\$P \$P/zstd"
  cat \$P/part.* | \$Z -d -q --long=27 -o \$P/model.gguf
  echo "$sha  \$P/model.gguf" | sha256sum -c
fi
EOF
done
cp "$tools" .bench/piece-1/
rm -rf "$tmp"
echo "$(basename "$MODEL"): $total bytes compressed, $n pieces (.bench/piece-1 .. piece-$n), sha256 $sha"
du -sb .bench/piece-* | awk -v t="$tree" '{printf "  %s: %d bytes with the tree\n", $2, $1 + t}'
