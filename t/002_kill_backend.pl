
# Copyright: the idempotency extension authors.
#
# 002_kill_backend.pl: kill -9 of a backend makes the postmaster reinitialize
# and run crash recovery.  Work of the killed backend's open transaction
# (claims, an in-transaction takeover, a finish) must vanish; committed
# claims must survive, still pending, with their tokens current until a
# takeover after their lease; the token sequence must never go back, also
# past the 100 tokens a batch drew in the killed transaction.
#
# Run as described at the top of t/001_restart.pl.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use List::Util qw(max);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = new_node('kill', port => 55442, conf => ['restart_after_crash = on'],
	extension => 1);

# Every token the server has handed out so far, committed or not.
my @tokens;
sub max_token { return max(0, @tokens); }

sub sql { return $node->safe_psql('postgres', $_[0]); }

sub lookup_summary
{
	my ($key) = @_;
	return sql(
		"SELECT status || ',' || attempt || ',' || coalesce(response_code::text, 'null') "
		  . "FROM idempotency.idem_lookup('$key')");
}

my $done_body   = q{'{"charge": "ch_1", "amount": 4200}'};
my $failed_body = q{'{"error": "card declined"}'};
my $late_body   = q{'{"from": "the dead session"}'};
my $new_body    = q{'{"from": "the new owner"}'};
my %md5;
$md5{done}   = body_md5($node, 'postgres', $done_body);
$md5{failed} = body_md5($node, 'postgres', $failed_body);
$md5{late}   = body_md5($node, 'postgres', $late_body);
$md5{new}    = body_md5($node, 'postgres', $new_body);

###############################################################################
# Part 1: kill -9 in the middle of an in-transaction claim
###############################################################################

my $c = claim($node, 'postgres', "'done', request => '{\"n\": 1}', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'done: claimed');
push @tokens, $c->{token};
sql("SELECT idempotency.idem_finish('done', $c->{token}, 200, $done_body)");

$c = claim($node, 'postgres', "'failed', request => '{\"n\": 2}', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'failed: claimed');
push @tokens, $c->{token};
sql("SELECT idempotency.idem_finish('failed', $c->{token}, 402, $failed_body, "
	  . "status => 'failed', retention => '2 days')");

# A committed claim whose lease runs out: the killed transaction takes it over.
$c = claim($node, 'postgres', "'expired', request => '{\"n\": 3}', lease => '1 second'");
is($c->{outcome}, 'claimed', 'expired: claimed');
push @tokens, $c->{token};
my $expired_token = $c->{token};

# A committed claim with a long lease: the killed transaction finishes it.
$c = claim($node, 'postgres', "'pend-fin', request => '{\"n\": 4}', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'pend-fin: claimed');
push @tokens, $c->{token};
my $pend_fin_token = $c->{token};

ok(wait_lease_over($node, 'postgres', '', 'expired'), 'lease of expired has ended');

my %before;
$before{$_} = stored_row($node, 'postgres', '', $_) foreach ('done', 'failed', 'pend-fin');
my $expired_before = sql(
	"SELECT status, attempt, encode(fingerprint, 'hex'), created_at "
	  . "FROM idempotency.keys WHERE key = 'expired'");

my $sa = $node->background_psql('postgres');
my $sa_pid = $sa->query_safe('SELECT pg_backend_pid()');
$sa->query_safe('BEGIN');

my $sa_fin = parse_claim($sa->query_safe(
	"SELECT $CLAIM_COLS FROM idempotency.idem_claim('fresh-fin', lease => '1 hour')"));
is($sa_fin->{outcome}, 'claimed', 'killed txn: fresh-fin claimed');
cmp_ok($sa_fin->{token}, '>', max_token(), 'killed txn: fresh-fin token above earlier tokens');
$sa->query_safe(
	"SELECT idempotency.idem_finish('fresh-fin', $sa_fin->{token}, 200, $late_body)");

my $sa_takeover = parse_claim($sa->query_safe(
	"SELECT $CLAIM_COLS FROM idempotency.idem_claim('expired', request => '{\"n\": 3}', lease => '1 hour')"));
is($sa_takeover->{outcome}, 'claimed', 'killed txn: expired taken over');
is($sa_takeover->{attempt}, 2,         'killed txn: takeover is attempt 2');

$sa->query_safe(
	"SELECT idempotency.idem_finish('pend-fin', $pend_fin_token, 200, $late_body)");

# The last claim of the killed transaction draws the first token after a
# checkpoint, which writes the sequence's WAL record: unless that record is
# made durable before the token is handed out, the crash loses it and the
# token is issued again.
sql('CHECKPOINT');
my $sa_fresh = parse_claim($sa->query_safe(
	"SELECT $CLAIM_COLS FROM idempotency.idem_claim('fresh', request => '{\"n\": 5}', lease => '1 hour')"));
is($sa_fresh->{outcome}, 'claimed', 'killed txn: fresh claimed');
is($sa_fresh->{attempt}, 1,         'killed txn: fresh attempt 1');
cmp_ok($sa_fresh->{token}, '>', $sa_takeover->{token}, 'killed txn: fresh token above earlier tokens');

# A batch in the same transaction draws 100 tokens (the sequence logs
# ahead several times on the way); their WAL is flushed once, before the
# batch returns them.
my $batch_max = $sa->query_safe(
	"SELECT max(token) || ',' || count(*) FILTER (WHERE outcome = 'claimed') "
	  . "FROM idempotency.idem_claim_many(ARRAY(SELECT 'batch-' || i "
	  . "FROM generate_series(1, 100) AS i), lease => '1 hour')");
like($batch_max, qr/^\d+,100$/, 'killed txn: a batch claims 100 keys');
$batch_max =~ s/,.*//;
cmp_ok($batch_max, '>', $sa_fresh->{token}, 'killed txn: the batch\'s tokens come after');

my @killed_tokens = ($sa_fresh->{token}, $sa_fin->{token}, $sa_takeover->{token},
	$batch_max);

# While the transaction is open, the others see none of it.
$c = claim($node, 'postgres', "'fresh', request => '{\"n\": 5}'");
is($c->{outcome},     'in_progress', 'open txn: fresh is in_progress for others');
is($c->{retry_after}, 1,             'open txn: retry_after 1 for an uncommitted claim');
is(sql("SELECT count(*) FROM idempotency.idem_lookup('fresh')"),
	'0', 'open txn: lookup does not see the uncommitted claim');
is(lookup_summary('pend-fin'), 'pending,1,null',
	'open txn: lookup does not see the uncommitted finish');

kill_backend($node, $sa_pid, 'in-transaction claim');
eval { $sa->quit; };

# The killed transaction left no trace.
foreach my $key ('fresh', 'fresh-fin')
{
	is(sql("SELECT count(*) FROM idempotency.idem_lookup('$key')"),
		'0', "after kill: $key is absent for lookup");
	is(sql("SELECT count(*) FROM idempotency.keys WHERE key = '$key'"),
		'0', "after kill: $key has no stored row");
}
$c = claim($node, 'postgres', "'fresh', request => '{\"n\": 5}', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'after kill: fresh is claimed');
is($c->{attempt}, 1,         'after kill: fresh as a first attempt');
cmp_ok($c->{token}, '>', max_token(), 'after kill: new token above every committed token');
foreach my $t (@killed_tokens)
{
	cmp_ok($c->{token}, '>', $t,
		"after kill: new token above token $t issued to the killed transaction");
}
push @tokens, @killed_tokens, $c->{token};
my $fresh_token = $c->{token};

$c = claim($node, 'postgres',
	"'fresh-fin', request => '{\"other\": true}', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'after kill: fresh-fin is claimed, with any payload');
is($c->{attempt}, 1,         'after kill: fresh-fin as a first attempt');
cmp_ok($c->{token}, '>', max_token(), 'after kill: fresh-fin token above every earlier token');
push @tokens, $c->{token};

# Committed keys are intact.
is(stored_row($node, 'postgres', '', $_), $before{$_},
	"after kill: stored row of $_ unchanged")
  foreach ('done', 'failed', 'pend-fin');

$c = claim($node, 'postgres', "'done', request => '{\"n\": 1}'");
is_deeply(
	[ @$c{qw(outcome status response_code body_md5 token)} ],
	[ 'replay', 'succeeded', 200, $md5{done}, undef ],
	'after kill: done replays its stored success');
$c = claim($node, 'postgres', "'failed', request => '{\"n\": 2}'");
is_deeply(
	[ @$c{qw(outcome status response_code body_md5 token)} ],
	[ 'replay', 'failed', 402, $md5{failed}, undef ],
	'after kill: failed replays its stored failure');

# The in-transaction takeover is undone: still attempt 1 ...
is( sql("SELECT status, attempt, encode(fingerprint, 'hex'), created_at "
		  . "FROM idempotency.keys WHERE key = 'expired'"),
	$expired_before, 'after kill: expired is as before the killed takeover');
is(lookup_summary('expired'), 'pending,1,null', 'after kill: expired is pending, attempt 1');

# ... so the next takeover is attempt 2, not 3, and both older tokens are dead.
$c = claim($node, 'postgres', "'expired', request => '{\"n\": 3}', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'after kill: expired is taken over');
is($c->{attempt}, 2,         'after kill: takeover is attempt 2');
cmp_ok($c->{token}, '>', max_token(), 'after kill: takeover token above every earlier token');
push @tokens, $c->{token};
my $expired_new = $c->{token};
my $row = stored_row($node, 'postgres', '', 'expired');
is( sqlstate_of($node, 'postgres',
		"SELECT idempotency.idem_finish('expired', $expired_token, 200, $late_body)"),
	'55006', 'after kill: the first owner\'s token is dead (55006)');
is( sqlstate_of($node, 'postgres',
		"SELECT idempotency.idem_finish('expired', $sa_takeover->{token}, 200, $late_body)"),
	'55006', 'after kill: the killed takeover\'s token is dead (55006)');
is(stored_row($node, 'postgres', '', 'expired'), $row,
	'after kill: the dead finishes changed nothing');
is( sqlstate_of($node, 'postgres',
		"SELECT idempotency.idem_finish('expired', $expired_new, 201, $new_body)"),
	'00000', 'after kill: the new owner finishes expired');
$c = claim($node, 'postgres', "'expired', request => '{\"n\": 3}'");
is_deeply(
	[ @$c{qw(outcome status response_code body_md5)} ],
	[ 'replay', 'succeeded', 201, $md5{new} ],
	'after kill: expired replays the new owner\'s result');

# The killed finish is undone: pend-fin is pending and its token still current.
is(lookup_summary('pend-fin'), 'pending,1,null', 'after kill: pend-fin still pending');
$c = claim($node, 'postgres', "'pend-fin', request => '{\"n\": 4}'");
is($c->{outcome}, 'in_progress', 'after kill: pend-fin is in progress (lease 1 hour)');
cmp_ok($c->{retry_after}, '>', 1, 'after kill: pend-fin retry_after counts its lease');
is( sqlstate_of($node, 'postgres',
		"SELECT idempotency.idem_finish('pend-fin', $pend_fin_token, 200, $late_body)"),
	'00000', 'after kill: pend-fin is finished with its pre-crash token');
$c = claim($node, 'postgres', "'pend-fin', request => '{\"n\": 4}'");
is_deeply(
	[ @$c{qw(outcome status response_code body_md5)} ],
	[ 'replay', 'succeeded', 200, $md5{late} ],
	'after kill: pend-fin replays');

###############################################################################
# Part 2: kill -9 after an autocommit claim committed, before its finish
###############################################################################

my $sb = $node->background_psql('postgres');
my $sb_pid = $sb->query_safe('SELECT pg_backend_pid()');
my $sb_auto = parse_claim($sb->query_safe(
	"SELECT $CLAIM_COLS FROM idempotency.idem_claim('auto', request => '{\"n\": 6}', lease => '1 second')"));
is($sb_auto->{outcome}, 'claimed', 'autocommit: auto claimed');
is($sb_auto->{attempt}, 1,         'autocommit: auto attempt 1');
cmp_ok($sb_auto->{token}, '>', max_token(), 'autocommit: auto token above earlier tokens');
my $sb_long = parse_claim($sb->query_safe(
	"SELECT $CLAIM_COLS FROM idempotency.idem_claim('auto-long', request => '{\"n\": 7}', lease => '1 hour')"));
is($sb_long->{outcome}, 'claimed', 'autocommit: auto-long claimed');
push @tokens, $sb_auto->{token}, $sb_long->{token};

# The process dies with the external side effect still running.
kill_backend($node, $sb_pid, 'autocommit claim');
eval { $sb->quit; };

is(lookup_summary('auto'),      'pending,1,null', 'after kill: auto is pending, attempt 1');
is(lookup_summary('auto-long'), 'pending,1,null', 'after kill: auto-long is pending, attempt 1');
is( sql("SELECT token FROM idempotency.keys WHERE key = 'auto-long'"),
	$sb_long->{token}, 'after kill: auto-long keeps its token');

# auto-long: its lease is live, so a retry waits its turn, and the token
# survived: a finish from the (restarted) owner goes through.
$c = claim($node, 'postgres', "'auto-long', request => '{\"n\": 7}'");
is($c->{outcome}, 'in_progress', 'after kill: auto-long is in progress');
is($c->{token},   undef,         'after kill: in_progress carries no token');
cmp_ok($c->{retry_after}, '>', 1, 'after kill: auto-long retry_after counts its lease');
is( sqlstate_of($node, 'postgres',
		"SELECT idempotency.idem_finish('auto-long', $sb_long->{token}, 200, $late_body)"),
	'00000', 'after kill: auto-long finished with the pre-crash token');
is(lookup_summary('auto-long'), 'succeeded,1,200', 'after kill: auto-long succeeded');

# auto: after its lease, the next claim takes over with attempt 2.
ok(wait_lease_over($node, 'postgres', '', 'auto'), 'lease of auto has ended');
$c = claim($node, 'postgres', "'auto', request => '{\"n\": 6}', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'after kill: auto is taken over after its lease');
is($c->{attempt}, 2,         'after kill: takeover is attempt 2');
cmp_ok($c->{token}, '>', max_token(), 'after kill: takeover token above every earlier token');
push @tokens, $c->{token};
my $auto_new = $c->{token};
is( sql("SELECT status || ',' || token || ',' || attempt FROM idempotency.keys WHERE key = 'auto'"),
	"pending,$auto_new,2", 'after kill: stored row has the new token and attempt 2');

$row = stored_row($node, 'postgres', '', 'auto');
is( sqlstate_of($node, 'postgres',
		"SELECT idempotency.idem_finish('auto', $sb_auto->{token}, 200, $late_body)"),
	'55006', 'after kill: the dead token\'s finish raises 55006');
is( sqlstate_of($node, 'postgres',
		"SELECT idempotency.idem_extend('auto', $sb_auto->{token}, '1 hour')"),
	'55006', 'after kill: the dead token\'s extend raises 55006');
is( sqlstate_of($node, 'postgres',
		"SELECT idempotency.idem_release('auto', $sb_auto->{token})"),
	'55006', 'after kill: the dead token\'s release raises 55006');
is(stored_row($node, 'postgres', '', 'auto'), $row,
	'after kill: the dead token changed nothing');

$c = claim($node, 'postgres', "'auto', request => '{\"n\": 6}'");
is($c->{outcome}, 'in_progress', 'after kill: auto is in progress under its new owner');
$c = claim($node, 'postgres', "'auto', request => '{\"n\": 666}'");
is($c->{outcome}, 'mismatch', 'after kill: auto with another request is a mismatch');

is( sqlstate_of($node, 'postgres',
		"SELECT idempotency.idem_finish('auto', $auto_new, 200, $new_body)"),
	'00000', 'after kill: the new owner finishes auto');
$c = claim($node, 'postgres', "'auto', request => '{\"n\": 6}'");
is_deeply(
	[ @$c{qw(outcome status response_code body_md5)} ],
	[ 'replay', 'succeeded', 200, $md5{new} ],
	'after kill: auto replays the new owner\'s result');
is(sql("SELECT attempt FROM idempotency.idem_lookup('auto')"), '2',
	'after kill: auto was finished by attempt 2');

###############################################################################
# Part 3: kill -9 while the claiming statement is still running
###############################################################################

my $m = $node->background_psql('postgres');
my $m_pid = $m->query_safe('SELECT pg_backend_pid()');
$m->query_until(qr/started/,
	"\\echo started\nSELECT c.token, pg_sleep(600) FROM idempotency.idem_claim('mid', lease => '1 hour') AS c;\n");
ok( $node->poll_query_until(
		'postgres',
		"SELECT wait_event = 'PgSleep' FROM pg_stat_activity WHERE pid = $m_pid"),
	'mid-statement: the claiming statement is running');
is(sql("SELECT count(*) FROM idempotency.idem_lookup('mid')"), '0',
	'mid-statement: the running claim is invisible');
$c = claim($node, 'postgres', "'mid'");
is($c->{outcome}, 'in_progress', 'mid-statement: others get in_progress');

kill_backend($node, $m_pid, 'running statement');
eval { $m->quit; };

is(sql("SELECT count(*) FROM idempotency.keys WHERE key = 'mid'"), '0',
	'after kill: the interrupted claim left no row');
$c = claim($node, 'postgres', "'mid', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'after kill: mid is claimed');
is($c->{attempt}, 1,         'after kill: mid as a first attempt');
cmp_ok($c->{token}, '>', max_token(), 'after kill: token above every earlier token');

# Everything committed before all three crashes is still there.
is(lookup_summary('done'),     'succeeded,1,200', 'end: done intact');
is(lookup_summary('failed'),   'failed,1,402',    'end: failed intact');
is(lookup_summary('expired'),  'succeeded,2,201', 'end: expired intact');
is(lookup_summary('pend-fin'), 'succeeded,1,200', 'end: pend-fin intact');
is(lookup_summary('auto'),     'succeeded,2,200', 'end: auto intact');

$node->stop;
done_testing();
