import json, math, sys
d=json.load(open('fp8_backends/data/selection/sm90-nvidia-h200.json'))
sec=list(d['sections'].values())[0]['entries']
rows=json.load(open(sys.argv[1]))['rows']
def parse(label):
    p, _, rest = label.partition('[')
    opts = dict(kv.split('=') for kv in rest.rstrip(']').split(',')) if rest else {}
    return p, opts
def match(cand, entry):
    p, o = parse(cand)
    return p == entry['provider'] and all(o.get(k) == v for k, v in entry['options'].items())
def key(r):
    return f"gemm/n={r['n']}/k={r['k']}/e4m3fn.e4m3fn->bfloat16/act=per_tensor/w=per_tensor/bias=0/m={r['m']}"
res = {}
for margin in (0.0, 0.0025, 0.005, 0.01, 0.02):
    vals=[]; below=0
    for r in rows:
        if r['source'] != 'shipped-exact': continue
        e = sec.get(key(r))
        if e is None: continue
        rk = e['ranking']; best = rk[0]['us']
        tied = [x for x in rk if x['us'] <= best*(1+margin)]
        # current behaviour: within margin -> the data's choice (static priority); margin 0 -> the fastest
        pick = e['choice'] if margin == 0.02 else (tied[0] if margin == 0 else None)
        if pick is None:
            # among tied, the one the shipped choice is if tied, else fastest
            pick = e['choice'] if any(x['provider']==e['choice']['provider'] and x['options']==e['choice']['options'] for x in tied) else rk[0]
        labs=[c for c in r['candidates'] if match(c, pick)]
        if not labs: print('nomatch', pick, list(r['candidates'])); continue
        s = r['fastest_us']/r['candidates'][labs[0]]
        vals.append(s); below += s < 0.97
    g = math.exp(sum(map(math.log, vals))/len(vals))
    print(f"margin {margin}: n={len(vals)} geomean {g:.4f} min {min(vals):.3f} below0.97 {below}")
