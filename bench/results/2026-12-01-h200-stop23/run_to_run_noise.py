import json, math, statistics, sys
sys.path.insert(0, '/tmp')
d=json.load(open('fp8_backends/data/selection/sm90-nvidia-h200.json'))
sec=list(d['sections'].values())[0]['entries']
rows=json.load(open('bench/results/2026-12-01-h200-stop23/call2/ingrid/auto_eval.json'))['rows']
def parse(label):
    p, _, rest = label.partition('[')
    opts = dict(kv.split('=') for kv in rest.rstrip(']').split(',')) if rest else {}
    return p, opts
def key(r): return f"gemm/n={r['n']}/k={r['k']}/e4m3fn.e4m3fn->bfloat16/act=per_tensor/w=per_tensor/bias=0/m={r['m']}"
rel=[]; flips=0; n=0
for r in rows:
    e=sec.get(key(r))
    if not e: continue
    ratios={}
    for c,us in r['candidates'].items():
        p,o=parse(c)
        for x in e['ranking']:
            if x['provider']==p and all(o.get(k)==v for k,v in x['options'].items()):
                ratios[c]=us/x['us']; break
    if len(ratios)<2: continue
    med=statistics.median(ratios.values())
    for c,v in ratios.items(): rel.append(v/med)
    n+=1
    # does the tuning's fastest stay within 3% of today's fastest?
rel.sort()
q=lambda p: rel[int(p*(len(rel)-1))]
print(f"points {n}, candidate timings {len(rel)}: eval/tuned, relative to the point's median ratio: "
      f"p1 {q(0.01):.3f} p5 {q(0.05):.3f} p50 {q(0.5):.3f} p95 {q(0.95):.3f} p99 {q(0.99):.3f}; beyond +-3%: {sum(abs(v-1)>0.03 for v in rel)}")
