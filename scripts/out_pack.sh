# Sourced by the scripts/gpu_*.sh: `trap out_pack EXIT` fits $OUT into what the device tool returns (its README: at
# most 8 files, 16 MiB each, 64 MiB in all, two folders down). At exit, every *.log and *.txt file goes into
# $OUT/logs.tgz. Each folder goes into NAME.tgz, split into 15 MiB parts (NAME.tgz.part00, ...) when larger. Here:
# `tar xzf logs.tgz`, and `cat NAME.tgz.part* | tar xz` for a split folder. JSON, Markdown and PNG files stay as they
# are. Prints what is left.
out_pack() {
  local out=${OUT:-}
  [ -n "$out" ] && [ -d "$out" ] || return 0
  (
    cd "$out" || exit 0
    shopt -s nullglob
    local logs=(*.log *.txt)
    if [ ${#logs[@]} -gt 0 ]; then
      local name=logs.tgz i=1
      while [ -e "$name" ]; do name=logs-$i.tgz; i=$((i + 1)); done  # a script called by another packs first
      tar czf "$name" --remove-files "${logs[@]}"
    fi
    for d in */; do
      d=${d%/}
      if [ "$(du -sb "$d" | cut -f1)" -gt 47185920 ]; then  # over 45 MiB: packing it would crowd out the rest
        echo "out_pack: $d is over 45 MiB, left as it is (its large files will not come back)"
        continue
      fi
      tar czf "$d.tgz" --remove-files "$d"
      if [ "$(stat -c %s "$d.tgz")" -gt 15728640 ]; then
        split -b 15M -d "$d.tgz" "$d.tgz.part" && rm -f "$d.tgz"
      fi
    done
    local n
    n=$(find . -maxdepth 1 -type f | wc -l)
    echo "=== out_pack: $n files in \$OUT$([ "$n" -gt 8 ] && echo ' (MORE THAN 8: some will not come back)')"
    ls -l | awk 'NR > 1 {print $5, $9}'
  ) || true
}
