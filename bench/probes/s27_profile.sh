OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu
tar -xJf .gpu_pack/bins.tar.xz -C .gpu
which nsys ncu > "$OUT/tools.txt" 2>&1; ls /usr/local/cuda*/bin 2>/dev/null | grep -i nsys >> "$OUT/tools.txt"
CONFIG=m3 SEQLEN=32768 PATTERN=clustered OUT=$OUT/p bash scripts/gpu_profile.sh > "$OUT/prof.log" 2>&1
NS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
if [ -n "$NS" ]; then
  timeout 200 "$NS" profile -o "$OUT/step" --stats=false ./.gpu/flashmsa_bench --config m3 --seqlens 32768 --patterns clustered --iters 3 --options 0 > "$OUT/nsys.log" 2>&1
  timeout 100 "$NS" stats -r cuda_gpu_trace -f csv -o "$OUT/trace" "$OUT/step.nsys-rep" >> "$OUT/nsys.log" 2>&1
  rm -f "$OUT/step.nsys-rep" "$OUT/step.sqlite"
fi
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz .)
