// The HTTP behaviour, over real HTTP against a real PostgreSQL, for the
// Express middleware and the Fastify plugin alike.
import { test, describe, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import pg from 'pg';
import { db, row, newKey, send, waitFor, frameworks, recordingPool, problemOf, createTestOrders } from './helpers.mjs';

const pool = new pg.Pool({ max: 10 });

before(async () => {
	await createTestOrders();
});

after(async () => {
	await pool.end();
	await db.end();
});

function assertProblem(answer, status, slug) {
	const p = problemOf(answer, status, slug);
	assert.ok(p.title && p.detail);
	assert.equal(answer.headers['idempotency-key-retention'], '86400');
	return p;
}

async function ordersFor(key) {
	const { rows } = await db.query('SELECT note FROM test_orders WHERE request_key = $1', [key]);
	return rows;
}

for (const fw of frameworks) {
	describe(`${fw.name}`, () => {
		let app;
		before(async () => { app = await fw.start({ pool }); });
		after(async () => { await app.close(); });

		describe('the Idempotency-Key header', () => {
			test('missing: 400 idempotency-key-missing, the handler does not run', async () => {
				const a = await send(app.url, '/echo');
				assertProblem(a, 400, 'idempotency-key-missing');
				assert.equal(app.control.runs.size, 0);
			});

			test('repeated: two field lines, or a list in one line, is 400 idempotency-key-repeated', async () => {
				const key = newKey();
				assertProblem(await send(app.url, '/echo', { keyLines: [`"${key}"`, `"${key}"`] }), 400, 'idempotency-key-repeated');
				assertProblem(await send(app.url, '/echo', { key: `"${key}", "other"` }), 400, 'idempotency-key-repeated');
				assertProblem(await send(app.url, '/echo', { key: 'abc, def' }), 400, 'idempotency-key-repeated');
				assert.equal(await row(key), null);
			});

			test('malformed: bad quoting, parameters, non-ASCII, control characters, empty, not a token', async () => {
				for (const bad of ['"unterminated', '""', '"a";p=1', 'abc;p=1', '"caf\u00e9"', '"a\tb"',
					'"bad\\escape"', '8e03978e 40d5', '(x)', '"a" x', '{x}']) {
					const p = assertProblem(await send(app.url, '/echo', { key: bad }), 400, 'idempotency-key-malformed');
					assert.ok(p.detail.length > 10);
				}
				assert.equal(app.control.runs.size, 0);
			});

			test('too long: 256 characters is 400 idempotency-key-too-long; 255 is accepted', async () => {
				const long = newKey().padEnd(256, 'x');
				const p = assertProblem(await send(app.url, '/echo', { key: `"${long}"` }), 400, 'idempotency-key-too-long');
				assert.match(p.detail, /256 characters long; the limit is 255/);
				const ok = newKey().padEnd(255, 'y');
				const a = await send(app.url, '/echo', { key: `"${ok}"` });
				assert.equal(a.status, 201, a.text);
				assert.equal((await row(ok)).status, 'succeeded');
			});

			test('a bare UUID that starts with a digit is the same key as its quoted form', async () => {
				const key = `8${newKey('uuid')}`;
				const first = await send(app.url, '/echo', { key });
				assert.equal(first.status, 201, first.text);
				const again = await send(app.url, '/echo', { key: `"${key}"` });
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.equal((await row(key)).status, 'succeeded');
			});

			test('the sf-string and the bare token name the same key; escapes are decoded', async () => {
				const key = newKey('tok');
				const first = await send(app.url, '/echo', { key: `"${key}"` });
				assert.equal(first.status, 201);
				const again = await send(app.url, '/echo', { key });
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.deepEqual(again.bytes, first.bytes);
				const escaped = await send(app.url, '/echo', { key: `"${key}\\"q\\\\"` });
				assert.equal(escaped.status, 201);
				assert.equal((await row(`${key}"q\\`)).status, 'succeeded');
			});

			test('uncovered methods pass through untouched', async () => {
				const a = await send(app.url, '/plain', { method: 'GET', body: '', type: null });
				assert.equal(a.status, 200);
				assert.deepEqual(JSON.parse(a.text), { plain: true, covered: false });
				assert.equal(a.headers['idempotency-key-retention'], undefined);
			});
		});

		describe('outcomes', () => {
			test('claimed then replay: stored row, same status and bytes, Idempotent-Replayed, retention header', async () => {
				const key = newKey();
				const first = await send(app.url, '/echo', { key });
				assert.equal(first.status, 201, first.text);
				assert.equal(first.headers['idempotent-replayed'], undefined);
				assert.equal(first.headers['idempotency-key-retention'], '86400');
				assert.equal(JSON.parse(first.text).attempt, 1);
				const r = await row(key);
				assert.equal(r.status, 'succeeded');
				assert.equal(r.attempt, 1);
				assert.equal(r.response_code, 201);
				assert.equal(r.response_body.v, 1);
				assert.match(r.response_body.headers['content-type'], /^application\/json/);
				assert.deepEqual(r.response_body.json, JSON.parse(first.text));
				const again = await send(app.url, '/echo', { key });
				assert.equal(again.status, 201);
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.equal(again.headers['idempotency-key-retention'], '86400');
				assert.equal(again.headers['content-type'], first.headers['content-type']);
				assert.deepEqual(again.bytes, first.bytes);
				assert.equal(app.control.count(key), 1);
			});

			test('a JSON body is sent as PostgreSQL keeps it, so the first answer and replays are the same bytes', async () => {
				const key = newKey();
				const first = await send(app.url, '/json-text', { key });
				assert.equal(first.text, '{"a": [1.50, 12345678901234567890], "b": 1}');
				assert.equal(first.headers['content-length'], String(first.bytes.length));
				const again = await send(app.url, '/json-text', { key });
				assert.deepEqual(again.bytes, first.bytes);
			});

			test('binary bodies: stored as base64, replayed byte for byte, fingerprinted by raw bytes', async () => {
				const key = newKey();
				const body = Buffer.from([0, 255, 254, 0x80, 10, 13, 0xc3, 0x28]);
				const first = await send(app.url, '/binary', { key, body, type: 'application/octet-stream' });
				assert.equal(first.status, 200);
				assert.equal(first.bytes.length, 512);
				const r = await row(key);
				assert.equal(r.response_body.json, undefined);
				assert.deepEqual(Buffer.from(r.response_body.base64, 'base64'), first.bytes);
				assert.equal(r.response_body.headers['content-type'], 'application/octet-stream');
				const again = await send(app.url, '/binary', { key, body, type: 'application/octet-stream' });
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.equal(again.headers['content-type'], 'application/octet-stream');
				assert.deepEqual(again.bytes, first.bytes);
				const changed = Buffer.from(body);
				changed[3] = 0x81;
				assertProblem(await send(app.url, '/binary', { key, body: changed, type: 'application/octet-stream' }), 422, 'idempotency-key-reused');
				assert.equal(app.control.count(key), 1);
			});

			test('text and empty bodies replay exactly', async () => {
				const key = newKey();
				const first = await send(app.url, '/text', { key });
				assert.equal((await row(key)).response_body.base64, Buffer.from('plain  text\n').toString('base64'));
				assert.deepEqual((await send(app.url, '/text', { key })).bytes, first.bytes);
				const empty = newKey();
				assert.equal((await send(app.url, '/empty', { key: empty })).status, 204);
				const r = await row(empty);
				assert.equal(r.response_code, 204);
				assert.deepEqual(Object.keys(r.response_body).sort(), ['headers', 'v']);
				const again = await send(app.url, '/empty', { key: empty });
				assert.equal(again.status, 204);
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.equal(again.bytes.length, 0);
			});

			test('the fingerprint is method, path with query and sha256 of the raw body', async () => {
				const key = newKey();
				const body = '{"amount": 100}';
				await send(app.url, '/echo?x=1', { key, body });
				const { rows } = await db.query(
					'SELECT fingerprint FROM idempotency.keys WHERE key = $1', [key]);
				const request = { method: 'POST', path: '/echo?x=1', body_sha256: createHash('sha256').update(body).digest('hex') };
				const { rows: expected } = await db.query(
					"SELECT sha256(convert_to($1::jsonb::text, 'UTF8')) AS fp", [JSON.stringify(request)]);
				assert.deepEqual(rows[0].fingerprint, expected[0].fp);
				// whitespace and key order are a different request; so are the query and the method
				assertProblem(await send(app.url, '/echo?x=1', { key, body: '{"amount":100}' }), 422, 'idempotency-key-reused');
				assertProblem(await send(app.url, '/echo?x=2', { key, body }), 422, 'idempotency-key-reused');
				assertProblem(await send(app.url, '/echo?x=1', { key, body, method: 'PATCH' }), 422, 'idempotency-key-reused');
				assert.equal((await send(app.url, '/echo?x=1', { key, body })).headers['idempotent-replayed'], 'true');
				assert.equal(app.control.count(key), 1);
			});

			test('a concurrent duplicate gets 409 idempotency-key-in-use with Retry-After, then the stored result', async () => {
				const key = newKey();
				const gate = app.control.gate(key);
				const first = send(app.url, '/slow', { key });
				await gate.entered.promise;
				const dup = await send(app.url, '/slow', { key });
				assertProblem(dup, 409, 'idempotency-key-in-use');
				assert.ok(Number(dup.headers['retry-after']) >= 1);
				assert.equal((await row(key)).status, 'pending');
				gate.release.resolve();
				const done = await first;
				assert.equal(done.status, 201);
				const again = await send(app.url, '/slow', { key });
				assert.deepEqual(again.bytes, done.bytes);
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.equal(app.control.count(key), 1);
			});
		});

		describe('status policy', () => {
			test('4xx is stored as failed and replayed', async () => {
				const key = newKey();
				const first = await send(app.url, '/status?code=402', { key });
				assert.equal(first.status, 402);
				const r = await row(key);
				assert.equal(r.status, 'failed');
				assert.equal(r.response_code, 402);
				const again = await send(app.url, '/status?code=402', { key });
				assert.equal(again.status, 402);
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.equal(app.control.count(key), 1);
			});

			for (const code of [408, 409, 425, 429, 500, 503]) {
				test(`${code} releases the key: nothing stored, the retry runs again`, async () => {
					const key = newKey();
					const first = await send(app.url, `/status?code=${code}`, { key });
					assert.equal(first.status, code);
					assert.equal(await row(key), null);
					const again = await send(app.url, `/status?code=${code}`, { key });
					assert.equal(again.headers['idempotent-replayed'], undefined);
					assert.equal(app.control.count(key), 2);
				});
			}

			test('2xx and 3xx are stored as succeeded', async () => {
				for (const code of [200, 202, 303]) {
					const key = newKey();
					assert.equal((await send(app.url, `/status?code=${code}`, { key })).status, code);
					assert.equal((await row(key)).status, 'succeeded');
				}
			});

			test('a thrown error releases the key and is the framework\'s own 500', async () => {
				const key = newKey();
				const a = await send(app.url, '/throw', { key });
				assert.equal(a.status, 500);
				assert.equal(await row(key), null);
				const b = await send(app.url, '/throw', { key });
				assert.equal(b.status, 500);
				assert.equal(app.control.count(key), 2);
			});

			test('storeHeaders: content-type and location are stored and replayed, others are not', async () => {
				const key = newKey();
				const first = await send(app.url, '/headers', { key });
				assert.equal(first.headers.location, '/things/7');
				assert.equal(first.headers['x-custom'], 'first-only');
				assert.deepEqual(Object.keys((await row(key)).response_body.headers).sort(), ['content-type', 'location']);
				const again = await send(app.url, '/headers', { key });
				assert.equal(again.headers.location, '/things/7');
				assert.equal(again.headers['x-custom'], undefined);
			});
		});

		describe('transactional mode', () => {
			test('the handler\'s write and the stored result commit together; a retry replays', async () => {
				const key = newKey();
				const first = await send(app.url, '/tx', { key, body: '{"note":"a"}' });
				assert.equal(first.status, 201, first.text);
				assert.equal((await ordersFor(key)).length, 1);
				assert.equal((await row(key)).status, 'succeeded');
				const again = await send(app.url, '/tx', { key, body: '{"note":"a"}' });
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.deepEqual(again.bytes, first.bytes);
				assert.equal((await ordersFor(key)).length, 1);
			});

			test('a thrown error rolls back the write and the claim: no trace of the key', async () => {
				const key = newKey();
				const failed = await send(app.url, '/tx', { key, body: '{"note":"x","fail":true}' });
				assert.equal(failed.status, 500);
				assert.equal(await row(key), null);
				assert.equal((await ordersFor(key)).length, 0);
				const retry = await send(app.url, '/tx', { key, body: '{"note":"y"}' });
				assert.equal(retry.status, 201);
				assert.deepEqual(await ordersFor(key), [{ note: 'y' }]);
			});

			test('a duplicate while the transaction is open gets 409 with Retry-After: 1', async () => {
				const key = newKey();
				const gate = app.control.gate(key);
				const first = send(app.url, '/tx', { key, body: '{"note":"t"}' });
				await gate.entered.promise;
				const dup = await send(app.url, '/tx', { key, body: '{"note":"t"}' });
				assertProblem(dup, 409, 'idempotency-key-in-use');
				assert.equal(dup.headers['retry-after'], '1');
				assert.equal(await row(key), null, 'the claim is not visible before COMMIT');
				gate.release.resolve();
				assert.equal((await first).status, 201);
				assert.equal((await ordersFor(key)).length, 1);
			});
		});

		describe('leases', () => {
			test('a handler slower than its lease is kept alive by the heartbeat: no takeover, attempt 1', async () => {
				let beats = 0;
				const slow = await fw.start({ pool, lease: 0.6, onHeartbeat: () => { beats++; } });
				try {
					const key = newKey();
					const gate = slow.control.gate(key);
					const first = send(slow.url, '/slow', { key });
					await gate.entered.promise;
					// four beats at lease/3 each: more than two leases have passed since the claim
					await waitFor(() => beats >= 6, 'six heartbeats');
					const dup = await send(slow.url, '/slow', { key });
					assert.equal(dup.status, 409, 'still owned: no takeover');
					gate.release.resolve();
					const done = await first;
					assert.equal(done.status, 201);
					assert.equal(JSON.parse(done.text).attempt, 1);
					const r = await row(key);
					assert.equal(r.status, 'succeeded');
					assert.equal(r.attempt, 1);
					assert.equal(slow.control.count(key), 1);
				} finally {
					await slow.close();
				}
			});

			test('a client that disconnects mid-handler does not cancel the stored result', async () => {
				const key = newKey();
				const gate = app.control.gate(key);
				const abort = new AbortController();
				const first = send(app.url, '/slow', { key, signal: abort.signal }).catch((err) => err);
				await gate.entered.promise;
				abort.abort();
				assert.ok((await first) instanceof Error);
				gate.release.resolve();
				const r = await waitFor(async () => (await row(key))?.status === 'succeeded' && row(key), 'the stored result');
				assert.equal(r.response_code, 201);
				const retry = await send(app.url, '/slow', { key });
				assert.equal(retry.status, 201);
				assert.equal(retry.headers['idempotent-replayed'], 'true');
				assert.deepEqual(JSON.parse(retry.text), r.response_body.json);
				assert.equal(app.control.count(key), 1);
			});

			test('a key taken over while the handler ran: 409 idempotency-key-lost, nothing stored', async () => {
				const key = newKey();
				const gate = app.control.gate(key);
				const first = send(app.url, '/slow', { key });
				await gate.entered.promise;
				// the lease ends and another attempt takes the key over
				await db.query(`UPDATE idempotency.keys SET lease_until = clock_timestamp() - interval '1 second'
				                 WHERE key = $1`, [key]);
				const { rows } = await db.query(
					'SELECT outcome, token::text AS token, attempt FROM idempotency.idem_claim(key => $1, request => $2::jsonb)',
					[key, JSON.stringify({ method: 'POST', path: '/slow', body_sha256: createHash('sha256').update('{"amount":100}').digest('hex') })]);
				assert.equal(rows[0].outcome, 'claimed');
				assert.equal(rows[0].attempt, 2);
				gate.release.resolve();
				const lost = await first;
				assertProblem(lost, 409, 'idempotency-key-lost');
				const r = await row(key);
				assert.equal(r.status, 'pending', 'the old attempt stored nothing');
				assert.equal(r.token, rows[0].token);
				assert.equal(r.response_body, null);
			});
		});

		describe('options', () => {
			test('scope: the same key in two scopes names two operations', async () => {
				const scoped = await fw.start({ pool, scope: (req) => String(req.headers['x-tenant'] ?? '') });
				try {
					const key = newKey();
					const a = await send(scoped.url, '/echo', { key, headers: { 'x-tenant': 'a' } });
					const b = await send(scoped.url, '/echo', { key, headers: { 'x-tenant': 'b' } });
					assert.equal(b.headers['idempotent-replayed'], undefined);
					assert.notEqual(a.text, b.text);
					assert.equal((await row(key, 'a')).status, 'succeeded');
					assert.equal((await row(key, 'b')).status, 'succeeded');
					assert.equal(await row(key, ''), null);
				} finally {
					await scoped.close();
				}
			});

			test('fingerprint(req), required: false, storeHeaders, storePolicy, problemTypeBase', async () => {
				const custom = await fw.start({
					pool,
					required: false,
					fingerprint: (req) => ({ amount: req.body?.amount ?? null }),
					storeHeaders: ['content-type', 'x-custom'],
					storePolicy: (s) => (s === 402 ? 'release' : s >= 400 ? 'failed' : 'succeeded'),
					problemTypeBase: 'https://errors.example/',
				});
				try {
					const key = newKey();
					await send(custom.url, '/echo', { key, body: '{"amount": 5}' });
					const same = await send(custom.url, '/echo', { key, body: '{ "amount":5, "note": 1 }' });
					assert.equal(same.headers['idempotent-replayed'], 'true');
					const other = await send(custom.url, '/echo', { key, body: '{"amount": 6}' });
					assert.equal(other.status, 422);
					assert.equal(JSON.parse(other.text).type, 'https://errors.example/idempotency-key-reused');
					const h = newKey();
					await send(custom.url, '/headers', { key: h });
					const again = await send(custom.url, '/headers', { key: h });
					assert.equal(again.headers['x-custom'], 'first-only');
					assert.equal(again.headers.location, '/things/7', 'storeHeaders adds to the default list');
					const p = newKey();
					await send(custom.url, '/status?code=402', { key: p });
					assert.equal(await row(p), null);
					const none = await send(custom.url, '/echo');
					assert.equal(none.status, 201);
					assert.equal(JSON.parse(none.text).attempt, undefined);
				} finally {
					await custom.close();
				}
			});
		});

		describe('cache of finished results', () => {
			test('a replay is served from memory without a database round trip; a different fingerprint is not', async () => {
				const counted = recordingPool(pool);
				const cached = await fw.start({ pool: counted, cache: { max: 2 } });
				try {
					const key = newKey();
					const first = await send(cached.url, '/echo', { key });
					const afterFirst = counted.count();
					const again = await send(cached.url, '/echo', { key });
					assert.equal(again.headers['idempotent-replayed'], 'true');
					assert.deepEqual(again.bytes, first.bytes);
					assert.equal(counted.count(), afterFirst, 'no statement for a cached replay');
					const other = await send(cached.url, '/echo', { key, body: '{"amount":101}' });
					assertProblem(other, 422, 'idempotency-key-reused');
					assert.equal(counted.count('claim'), 2, 'the different fingerprint went to the database');
					// LRU: two more keys push this one out, and its next replay asks the database
					await send(cached.url, '/echo', { key: newKey() });
					await send(cached.url, '/echo', { key: newKey() });
					const claims = counted.count('claim');
					const evicted = await send(cached.url, '/echo', { key });
					assert.equal(evicted.headers['idempotent-replayed'], 'true');
					assert.equal(counted.count('claim'), claims + 1);
					assert.equal(counted.count('lookup'), 1, 'one lookup for the expiry on the first replay');
					const cachedAgain = counted.count();
					await send(cached.url, '/echo', { key });
					assert.equal(counted.count(), cachedAgain);
				} finally {
					await cached.close();
				}
			});

			test('off by default: every replay asks the database', async () => {
				const counted = recordingPool(pool);
				const plain = await fw.start({ pool: counted });
				try {
					const key = newKey();
					await send(plain.url, '/echo', { key });
					await send(plain.url, '/echo', { key });
					await send(plain.url, '/echo', { key });
					assert.equal(counted.count('claim'), 3);
				} finally {
					await plain.close();
				}
			});
		});
	});
}
