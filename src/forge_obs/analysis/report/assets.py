"""The report page's stylesheet and script (inline: the page opens offline, from a file).

The script draws every ``<figure class="chart">`` from the JSON in ``<script id="run-data">``:
the x-axis (step or wall time), W&B-style smoothing (a debiased exponential moving average, the
raw line kept faint behind it), a hover read-out, stacked areas for the step-time breakdown.
It sets ``document.body.dataset.drawn`` to the number of charts drawn once it is done.
"""

__all__ = ["CSS", "JS"]

CSS = """
:root{--fg:#1d1d1f;--muted:#777;--line:#e2e2e2;--bg:#f7f7f8;--card:#fff;--bad:#b3261e}
*{box-sizing:border-box}
body{font:13px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:var(--fg);background:var(--bg)}
header{position:sticky;top:0;z-index:5;background:var(--card);border-bottom:1px solid var(--line);padding:6px 16px;
 display:flex;flex-wrap:wrap;gap:6px 18px;align-items:center}
header h1{font-size:15px;margin:0}
header .facts{color:var(--muted)}
header label{white-space:nowrap}
header input[type=range]{vertical-align:middle;width:120px}
nav a{margin-right:10px;color:#2b5ea7;text-decoration:none}
main{padding:4px 16px 24px}
section{margin:10px 0 14px}
h2{font-size:14px;margin:14px 0 6px;border-bottom:1px solid var(--line);padding-bottom:2px}
h3{font-size:13px;margin:10px 0 4px}
.muted{color:var(--muted)}
.grid{display:grid;gap:8px;grid-template-columns:repeat(auto-fill,minmax(300px,1fr))}
.grid.big{grid-template-columns:repeat(auto-fill,minmax(420px,1fr))}
figure.chart{margin:0;background:var(--card);border:1px solid var(--line);border-radius:4px;padding:4px 6px 2px;
 min-width:0;position:relative}
figure.chart:target,figure.chart.flash{outline:2px solid #f0a020}
figcaption{font-size:12px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
figcaption .stat{color:var(--muted);margin-left:6px}
.plot{position:relative}
svg{display:block}
svg text{font-size:10px;fill:#666}
svg .frame{fill:#fff;stroke:#d6d6d6}
svg .grid{stroke:#eee}
svg .hover{stroke:#999;stroke-dasharray:2,2}
.legend{font-size:11px;line-height:1.25}
.legend span{margin-right:8px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:3px;margin-right:3px;vertical-align:middle}
.tip{position:fixed;pointer-events:none;background:rgba(255,255,255,.96);border:1px solid #ccc;border-radius:3px;
 padding:3px 6px;font-size:11px;z-index:10;display:none;white-space:nowrap}
.badge{background:#fde8e6;color:var(--bad);padding:0 4px;border-radius:3px;font-size:11px;text-decoration:none}
ul.findings{margin:4px 0;padding-left:18px}
ul.findings li{margin:3px 0}
ul.findings details{display:inline}
ul.findings pre{margin:2px 0 0;font-size:11px;white-space:pre-wrap}
.ok{color:#1e7d3c}
table.kv{border-collapse:collapse}
table.kv th{text-align:left;font-weight:600;padding:1px 12px 1px 0;vertical-align:top;white-space:nowrap}
table.kv td{padding:1px 16px 1px 0;vertical-align:top}
.settings{display:grid;grid-template-columns:repeat(auto-fill,minmax(230px,1fr));gap:0 14px;font-size:12px}
.settings div{white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.settings b{font-weight:600}
.flat{display:grid;grid-template-columns:repeat(auto-fill,minmax(330px,1fr));gap:0 14px;font-size:12px;margin-top:4px}
.flat div{white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.flat code{font:inherit;font-weight:600}
details>summary{cursor:pointer}
table.samples{border-collapse:collapse;font-size:12px}
table.samples td,table.samples th{border:1px solid #ddd;padding:2px 6px;max-width:420px;overflow-wrap:anywhere}
footer{color:var(--muted);font-size:11px;padding:8px 16px}
"""

JS = r"""
(function(){
'use strict';
var D=JSON.parse(document.getElementById('run-data').textContent);
var axis=location.hash==='#wall'?'wall':'step', smooth=D.smoothing;
var tip=document.createElement('div');tip.className='tip';
var NS='http://www.w3.org/2000/svg';
var PAD={l:50,r:8,t:6,b:20};

function num(v){return typeof v==='number';}
function fmt(v){
  if(!num(v)){return String(v);}
  if(v===0){return '0';}
  var a=Math.abs(v);
  if(a>=1e6||a<1e-3){return v.toExponential(2).replace('e+','e');}
  if(Number.isInteger(v)){return String(v);}
  return String(parseFloat(v.toPrecision(4)));
}
function fmtDt(s){var a=Math.abs(s);
  if(a<120){return (a>=10||s===0?s.toFixed(0):s.toFixed(1))+'s';}
  if(a<7200){return (s/60).toFixed(1)+'m';} return (s/3600).toFixed(1)+'h';}
function ticks(lo,hi,n){
  if(!(isFinite(lo)&&isFinite(hi))){return [];}
  if(hi===lo){return [lo];}
  var raw=(hi-lo)/n,mag=Math.pow(10,Math.floor(Math.log10(raw))),st=10*mag,m=[1,2,2.5,5,10];
  for(var i=0;i<m.length;i++){if(m[i]*mag>=raw){st=m[i]*mag;break;}}
  var out=[],v=Math.ceil(lo/st)*st;
  while(v<=hi+st*1e-9&&out.length<20){out.push(parseFloat(v.toPrecision(12)));v+=st;}
  return out;
}
// the x positions of a line: its rows' steps or wall times (seconds since the run's first row)
function rows(src,label){return src==='r'?D.rl[label]:D.g;}
function xsOf(ln){var R=rows(ln.src,ln.label);return axis==='wall'?R.w:R.s;}
function ysOf(ln){
  if(ln.src==='r'){return (D.r[ln.key]||{})[ln.label]||[];}
  return (ln.src==='x'?D.x[ln.key]:D.s[ln.key])||[];}
// W&B's smoothing: exponential moving average, debiased; non-finite and absent values skipped
function ema(ys,w){
  var out=new Array(ys.length),last=0,n=0;
  for(var i=0;i<ys.length;i++){var y=ys[i];
    if(num(y)){last=last*w+(1-w)*y;n++;out[i]=last/(1-Math.pow(w,n));}else{out[i]=null;}}
  return out;
}
function pts(xs,ys){var o=[];for(var i=0;i<ys.length;i++){if(num(ys[i])&&num(xs[i])){o.push([xs[i],ys[i],i]);}}return o;}
function el(tag,attrs,parent){var e=document.createElementNS(NS,tag);
  for(var k in attrs){e.setAttribute(k,attrs[k]);} if(parent){parent.appendChild(e);} return e;}

function draw(fig){
  var spec=JSON.parse(fig.getAttribute('data-spec'));
  var box=fig.querySelector('.plot');
  var W=box.clientWidth; if(W<50){return false;}
  var H=spec.h, pw=W-PAD.l-PAD.r, ph=H-PAD.t-PAD.b;
  var series=[], allX=[], allY=[];
  spec.lines.forEach(function(ln){
    var xs=xsOf(ln), ys=ysOf(ln), raw=pts(xs,ys);
    var sm=(smooth>0&&raw.length>2)?pts(xs,ema(ys,smooth)):null;
    series.push({ln:ln,xs:xs,ys:ys,raw:raw,sm:sm});
    raw.forEach(function(p){allX.push(p[0]);allY.push(p[1]);});
  });
  if(spec.stack){ // cumulative, on the smoothed values when smoothing is on
    var base={};
    series.forEach(function(s){var src=s.sm||s.raw;s.stack=src.map(function(p){
      var b=base[p[2]]||0,t=b+Math.max(p[1],0);base[p[2]]=t;return [p[0],b,t,p[1]];});});
    allY=[0];series.forEach(function(s){s.stack.forEach(function(q){allY.push(q[2]);});});
  }
  var svg=el('svg',{width:W,height:H});
  if(!allX.length){var t=el('text',{x:W/2,y:H/2,'text-anchor':'middle'},svg);t.textContent='no finite values';
    box.replaceChildren(svg);return true;}
  var x0=Math.min.apply(null,allX),x1=Math.max.apply(null,allX),y0=Math.min.apply(null,allY),y1=Math.max.apply(null,allY);
  if(x1===x0){x0-=1;x1+=1;}
  if(y1===y0){var pad=Math.abs(y0)*0.1||1;y0-=pad;y1+=pad;}
  function sx(x){return PAD.l+(x-x0)/(x1-x0)*pw;} function sy(y){return PAD.t+ph-(y-y0)/(y1-y0)*ph;}
  el('rect',{x:PAD.l,y:PAD.t,width:pw,height:ph,'class':'frame'},svg);
  ticks(y0,y1,4).forEach(function(v){var y=sy(v).toFixed(1);
    el('line',{x1:PAD.l,x2:PAD.l+pw,y1:y,y2:y,'class':'grid'},svg);
    el('text',{x:PAD.l-4,y:+y+3,'text-anchor':'end'},svg).textContent=fmt(v);});
  ticks(x0,x1,Math.max(2,Math.floor(pw/70))).forEach(function(v){var x=sx(v).toFixed(1);
    el('line',{x1:x,x2:x,y1:PAD.t,y2:PAD.t+ph,'class':'grid'},svg);
    var anchor=sx(v)>W-PAD.r-12?'end':'middle'; // the last label stays inside the chart
    el('text',{x:x,y:PAD.t+ph+13,'text-anchor':anchor},svg).textContent=axis==='wall'?fmtDt(v):fmt(v);});
  series.forEach(function(s){
    var c=s.ln.color;
    if(spec.stack){
      if(!s.stack.length){return;}
      var up=s.stack.map(function(q){return sx(q[0]).toFixed(1)+','+sy(q[2]).toFixed(1);});
      var dn=s.stack.slice().reverse().map(function(q){return sx(q[0]).toFixed(1)+','+sy(q[1]).toFixed(1);});
      el('polygon',{points:up.concat(dn).join(' '),fill:c,'fill-opacity':0.55,stroke:c,'stroke-width':0.8},svg);
      return;
    }
    if(s.raw.length===1){el('circle',{cx:sx(s.raw[0][0]),cy:sy(s.raw[0][1]),r:2.5,fill:c},svg);return;}
    var rawPts=s.raw.map(function(p){return sx(p[0]).toFixed(1)+','+sy(p[1]).toFixed(1);}).join(' ');
    el('polyline',{points:rawPts,fill:'none',stroke:c,'stroke-width':s.sm?1:1.5,'stroke-opacity':s.sm?0.28:1},svg);
    if(s.sm){el('polyline',{points:s.sm.map(function(p){return sx(p[0]).toFixed(1)+','+sy(p[1]).toFixed(1);}).join(' '),
      fill:'none',stroke:c,'stroke-width':1.7},svg);}
    for(var i=0;i<s.ys.length;i++){ // non-finite values: a red mark at the top
      if(s.ys[i]!==null&&!num(s.ys[i])&&num(s.xs[i])){
        el('path',{d:'M'+(sx(s.xs[i])-3)+','+PAD.t+'l3,5l3,-5z',fill:'#d62728'},svg);}}
  });
  var rule=el('line',{y1:PAD.t,y2:PAD.t+ph,'class':'hover',visibility:'hidden'},svg);
  svg.addEventListener('mousemove',function(ev){
    var r=svg.getBoundingClientRect(),xv=x0+(ev.clientX-r.left-PAD.l)/pw*(x1-x0),html=[],bx=null;
    series.forEach(function(s){
      var best=null;s.raw.forEach(function(p){if(best===null||Math.abs(p[0]-xv)<Math.abs(best[0]-xv)){best=p;}});
      if(!best){return;} if(bx===null){bx=best[0];}
      var smv=s.sm?s.sm.filter(function(p){return p[2]===best[2];})[0]:null;
      html.push('<i style="color:'+s.ln.color+'">&#9632;</i> '+esc(s.ln.name)+': '+fmt(best[1])+(smv?' (smoothed '+fmt(smv[1])+')':''));
    });
    if(bx===null){return;}
    rule.setAttribute('x1',sx(bx));rule.setAttribute('x2',sx(bx));rule.setAttribute('visibility','visible');
    tip.innerHTML=(axis==='wall'?'t = '+fmtDt(bx):'step '+fmt(bx))+'<br>'+html.join('<br>');
    tip.style.display='block';tip.style.left=(ev.clientX+14)+'px';tip.style.top=(ev.clientY+10)+'px';
  });
  svg.addEventListener('mouseleave',function(){tip.style.display='none';rule.setAttribute('visibility','hidden');});
  box.replaceChildren(svg);
  return true;
}
function esc(s){return String(s).replace(/[&<>"']/g,function(c){return '&#'+c.charCodeAt(0)+';';});}
function drawAll(){
  var n=0,figs=document.querySelectorAll('figure.chart');
  for(var i=0;i<figs.length;i++){if(draw(figs[i])){n++;}}
  document.body.dataset.drawn=String(n);
}
var queued=false;
function redraw(){if(!queued){queued=true;requestAnimationFrame(function(){queued=false;drawAll();});}}
function setAxis(a){axis=a;var bs=document.querySelectorAll('button[data-axis]');
  for(var i=0;i<bs.length;i++){bs[i].setAttribute('aria-pressed',String(bs[i].dataset.axis===a));}
  redraw();}
document.addEventListener('DOMContentLoaded',function(){
  document.body.appendChild(tip);
  var bs=document.querySelectorAll('button[data-axis]');
  for(var i=0;i<bs.length;i++){bs[i].addEventListener('click',function(){setAxis(this.dataset.axis);});}
  var sl=document.getElementById('smoothing'),out=document.getElementById('smoothing-value');
  sl.value=smooth;out.textContent=Number(smooth).toFixed(2);
  sl.addEventListener('input',function(){smooth=parseFloat(sl.value);out.textContent=smooth.toFixed(2);redraw();});
  var ds=document.querySelectorAll('details');
  for(var j=0;j<ds.length;j++){ds[j].addEventListener('toggle',redraw);}
  window.addEventListener('resize',redraw);
  setAxis(axis);
  drawAll();
  document.body.dataset.ready='1';
});
})();
"""
